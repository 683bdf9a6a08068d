"""Run under `accelerate launch --num_processes 2`: each rank holds DIFFERENT data; the search reduces the sums
in one collective, so both ranks must choose the same bounds, equal to a plain loop over the union of the data.
Writes one JSON file per rank to the directory given as argv[1]."""

import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

from bapo_trl import search_clip_bounds
from bapo_trl.cli.train import exit_past_gloo_teardown
from bapo_trl.core.clipping_reference import loop_search

accelerator = Accelerator(cpu=True)
rank, world = accelerator.process_index, accelerator.num_processes
calls = {"n": 0}


def reduce_sum(t):
    calls["n"] += 1
    return accelerator.reduce(t, reduction="sum")


records = []
for case in range(40):
    gen = torch.Generator().manual_seed(1000 * case + rank)  # different data on every rank
    batch, length = 4, 8 + rank * 3  # even the shapes differ
    ratio = torch.exp(torch.randn(batch, length, generator=gen) * 0.6)
    adv = torch.randn(batch, generator=gen) - 0.3 * (rank + 1)
    mask = (torch.rand(batch, length, generator=gen) < 0.8).float()
    if case % 10 == 3 and rank == 1:
        mask.zero_()  # a rank with nothing to contribute must still join the collective
    variant = "paper" if case % 2 == 0 else "verl"
    before = calls["n"]
    result = search_clip_bounds(ratio, adv, mask, reduce_fn=reduce_sum, bapo_variant=variant).as_floats()
    collectives = calls["n"] - before
    local = search_clip_bounds(ratio, adv, mask, bapo_variant=variant).as_floats()
    # the reference: a plain loop over the union of every rank's tokens
    flat = torch.stack([ratio.flatten(), adv[:, None].expand_as(ratio).flatten(), mask.flatten()])
    gathered = [None] * world
    dist.all_gather_object(gathered, flat)
    union = torch.cat(gathered, dim=1)
    ref = loop_search(union[0][None], union[1][None], union[2][None], bapo_variant=variant)
    records.append({"case": case, "global": result, "local": local, "reference": ref, "collectives": collectives})

out = {
    "rank": rank,
    "world_size": world,
    "distributed_type": str(accelerator.distributed_type),
    "backend": dist.get_backend() if dist.is_initialized() else None,
    "records": records,
}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
accelerator.wait_for_everyone()

exit_past_gloo_teardown()  # gloo can abort a finished process while the interpreter finalizes (see its docstring)
