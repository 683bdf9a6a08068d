

def test_importing_the_candidates_warns_as_trls_experimental_does():
    """``import bapo_trl.experimental`` warns once (its own category, like TRL's ``trl.experimental``); the variable
    silences it. In a fresh process each, so the first import is this one."""
    import os
    import subprocess
    import sys

    code = ("import warnings\nwarnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    import bapo_trl.experimental.gmpo\n"
            "print(sum(type(w.message).__name__ == 'BAPOExperimentalWarning' for w in caught))\n")
    env = {k: v for k, v in os.environ.items() if k != "BAPO_TRL_EXPERIMENTAL_SILENCE"}
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**env, "BAPO_TRL_EXPERIMENTAL_SILENCE": "1"})
    assert (loud.stdout.strip(), quiet.stdout.strip()) == ("1", "0"), (loud.stderr[-2000:], quiet.stderr[-2000:])
