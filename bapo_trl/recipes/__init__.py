"""Tasks and assets the command line trains and evaluates on; the trainer imports nothing from here.

* ``toy/``: the embedded tiny model, tokenizer and reversal task (offline, cached);
* ``math_reasoning/``: the math recipe: dataset formats (``data``), boxed-answer rewards (``rewards``), avg@k /
  pass@k evaluation (``evaluate``; the command is ``bapo evaluate``) and the shipped chat arithmetic task;
* ``models.py``: registry models (SmolLM2-135M-Instruct converted offline; the command is ``bapo models``);
* ``reward_funcs.py``: reward functions by registry name or dotted import path; ``datasets_io.py``: one dataset split
  from a file, a saved directory or the hub.
"""
