"""generation/processes.py: the main process's error raised on every process. The broadcast here is a stand-in (a
function returning what the main process sent); the real collective runs in the multi-process launch tests
(tests/test_launch.py, tests/test_async_generation.py's two-process rows)."""

import pytest

from bapo_trl.generation.processes import raise_everywhere, raise_if_any, raised_on_every_process


class Sent:
    """What the main process broadcast, as every other process receives it."""

    def __init__(self, main_error):
        self.main_error = main_error
        self.calls = 0

    def __call__(self, obj):
        self.calls += 1
        e = self.main_error
        return None if e is None else (type(e).__name__, str(e))


def test_one_process_raises_its_own_error_and_never_broadcasts():
    sent = Sent(None)
    raise_everywhere(None, 1, sent, "x")
    with pytest.raises(KeyError):
        raise_everywhere(KeyError("k"), 1, sent, "x")
    assert sent.calls == 0


def test_another_process_raises_the_main_error_as_the_kind_it_names_else_the_default():
    class WeightSyncError(RuntimeError):
        pass

    sent = Sent(WeightSyncError("disk full"))
    with pytest.raises(WeightSyncError, match="^on the main process: WeightSyncError: disk full$"):
        raise_everywhere(None, 2, sent, "on the main process", kinds={"WeightSyncError": WeightSyncError})
    sent = Sent(ValueError("bad"))
    with pytest.raises(ConnectionError, match="async failed: ValueError: bad"):
        raise_everywhere(None, 2, sent, "async failed", default=ConnectionError)


def test_the_main_process_raises_its_own_error_and_nobody_raises_when_all_is_well():
    error = OSError("refused")
    with pytest.raises(OSError) as caught:
        raise_everywhere(error, 4, Sent(error), "x")
    assert caught.value is error
    sent = Sent(None)
    raise_everywhere(None, 4, sent, "x")
    assert sent.calls == 1  # every process enters the collective, even when nothing failed


def test_one_process_broadcast_hands_back_its_own_object_without_a_collective(monkeypatch):
    import accelerate.utils

    from bapo_trl.generation.processes import broadcast_from_main

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", lambda *a, **k: pytest.fail("collective called"))
    obj = {"a": 1}
    assert broadcast_from_main(obj, 1) is obj


def gathered(*errors):
    """What every process receives from a gather of each process's error (a stand-in for the collective)."""
    sent = [None if e is None else (type(e).__name__, str(e)) for e in errors]
    return lambda obj: sent


@pytest.mark.parametrize("errors, raised", [
    ((None, None, None), None),
    ((None, KeyError("k"), None), "^save: on process 1: KeyError: 'k'$"),
    ((OSError("disk"), None, ValueError("v")), "^save: on process 0: OSError: disk$"),
])
def test_any_process_error_is_raised_on_every_process_each_raising_its_own(errors, raised):
    for index, own in enumerate(errors):
        if own is not None:
            with pytest.raises(type(own)) as caught:
                raise_if_any(own, len(errors), "save", gathered(*errors))
            assert caught.value is own, index
        elif raised is None:
            raise_if_any(None, len(errors), "save", gathered(*errors))
        else:
            with pytest.raises(RuntimeError, match=raised):
                raise_if_any(None, len(errors), "save", gathered(*errors))


def test_one_process_raises_its_own_error_without_a_collective():
    def no_collective(obj):
        pytest.fail("collective called")

    raise_if_any(None, 1, "x", no_collective)
    with pytest.raises(KeyError):
        raise_if_any(KeyError("k"), 1, "x", no_collective)


def test_a_block_left_failed_or_not_enters_the_same_collective():
    """``raised_on_every_process``: the process whose block failed raises its own error, the others the first
    failure's, and each went through one gather (the failed one too, else the others would wait in it)."""
    calls = []

    def gather_with(*errors):
        def gather(obj):
            calls.append(obj)
            return gathered(*errors)(obj)
        return gather

    with pytest.raises(KeyError):
        with raised_on_every_process(2, "saving", gather_with(KeyError("k"), None)):
            raise KeyError("k")
    with pytest.raises(RuntimeError, match="^saving: on process 0: KeyError: 'k'$"):
        with raised_on_every_process(2, "saving", gather_with(KeyError("k"), None)):
            pass
    with raised_on_every_process(2, "saving", gather_with(None, None)):
        pass
    assert calls == [("KeyError", "'k'"), None, None]
    with pytest.raises(KeyboardInterrupt):  # an interrupt is not shared: it stops this process where it is
        with raised_on_every_process(2, "saving", gather_with(None, None)):
            raise KeyboardInterrupt
    assert len(calls) == 3


def test_a_prompt_whose_image_tokens_miss_its_images_fails_on_every_process():
    """Review s9, F6: TRL's ``_place_features`` raises on the main process (two image feature sets, one run of image
    tokens), between the image-feature request and the generation request, outside the failure-sharing client: the
    other processes waited in TRL's broadcast. Inside it the error goes to that client, whose generate call answers
    the failure (which every process raises on using it); with one process it is raised as TRL raises it. STAND-IN
    client, no broadcast (the launch test's generation row runs the collective)."""
    from types import SimpleNamespace

    from bapo_trl.generation.http_client import FailureSharingClient
    from bapo_trl.generation.vllm_generation import BAPOVLLMGeneration
    from support.trl_stand_ins import StandInClient

    backend = BAPOVLLMGeneration.__new__(BAPOVLLMGeneration)
    backend.processing_class = SimpleNamespace(image_token_id=7)
    two_images = {"mm_placeholders": {"image": [{"offset": 0, "length": 1}, {"offset": 4, "length": 1}]}}
    backend.vllm_client = StandInClient()
    with pytest.raises(ValueError, match="1 runs of image tokens in the prompt but 2 images"):
        backend._place_features(two_images, [7, 1, 2, 3])
    backend.vllm_client = FailureSharingClient(StandInClient())
    assert backend._place_features(two_images, [7, 1, 2, 3]) is None
    answer = backend.vllm_client.generate(prompts=[[7, 1, 2, 3]], features=[None])
    with pytest.raises(RuntimeError, match="^generation on the main process: ValueError: Found 1 runs of image"):
        list(answer["prompt_ids"])  # what TRL does first with the broadcast answer, on every process
