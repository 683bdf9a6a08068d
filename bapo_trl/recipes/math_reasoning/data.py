r"""Math RL datasets -> the two columns the trainer and :mod:`bapo_trl.recipes.math_reasoning.rewards` use.

``prompt``: chat messages, the problem plus an instruction to put the final answer in ``\boxed{}`` (as a system
message, or appended to the user message: DeepSeek-R1 models are meant to be run without a system prompt).
``answer``: the reference answer as text.

Datasets differ only in where the problem and the answer are and what wraps them, so each layout is a row of
configuration in :data:`MATH_FORMATS`, not a loader of its own:

* ``question`` / ``answer``: column paths; ``a.b`` reads a field of a struct column, ``a.0.b`` an element of a list;
* ``answer_from``: how to get the final answer out of the answer column (:data:`EXTRACTORS`): ``text`` (as is),
  ``after_hashes`` (GSM8K's ``#### 42``), ``last_boxed`` (a worked solution), ``json_list`` (first entry of a JSON
  list, else the text);
* ``strip``: regular expressions removed from the problem (instructions a dataset already wraps it in, which
  would contradict ours);
* ``hub_ids``: dataset ids recognised by ``format="auto"``; ``config``: the hub config used when none is given.

Column names were checked against the dataset cards as indexed by our search tool, not by loading the datasets
(no downloads here); the entries say which details could not be checked.
"""

from __future__ import annotations

import json
import re

from .rewards import last_boxed

#: The instruction added to every problem.
SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

# DAPO-Math-17k wraps every problem in an instruction to end with a line "Answer: ..."; we ask for a box instead.
_DAPO_PREFIX = (r"^\s*Solve the following math problem step by step\. The last line of your response should be of the "
                r"form Answer: \$Answer \(without quotes\) where \$Answer is the answer to the problem\.\s*")
_DAPO_SUFFIX = r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$"
# A trailing sentence asking for a boxed answer (kept by some converted datasets); ours replaces it.
_BOXED_INSTRUCTION = r"\s*[^.?!\n]*\\boxed\{\}[^.?!\n]*\.?\s*$"

MATH_FORMATS: dict[str, dict] = {
    # {"problem", "answer"}: the shipped tests/data/math_problems.jsonl, MATH-500, AIME 2024/2025 sets.
    "problem_answer": dict(
        question="problem", answer="answer", answer_from="text",
        hub_ids=["HuggingFaceH4/MATH-500", "HuggingFaceH4/aime_2024", "AI-MO/aimo-validation-aime",
                 "yentinglin/aime_2025", "math-ai/aime24", "math-ai/aime25"],
        # Not checked: the column names of yentinglin/aime_2025 and math-ai/aime24|25 (assumed problem/answer).
    ),
    # {"question", "answer"} with GSM8K's "reasoning ... #### 42" answers (a plain answer is kept as it is).
    "gsm8k": dict(
        question="question", answer="answer", answer_from="after_hashes",
        hub_ids=["openai/gsm8k", "gsm8k"], config="main",
    ),
    # Worked solutions whose final answer is boxed: the MATH train/test sets (lighteval layout).
    "math": dict(
        question="problem", answer="solution", answer_from="last_boxed",
        hub_ids=["DigitalLearningGmbH/MATH-lighteval", "EleutherAI/hendrycks_math", "hendrycks/competition_math"],
        # Not checked: EleutherAI/hendrycks_math needs a subject config (algebra, ...); there is no "all" config.
    ),
    # The verl RL layout: prompt = chat messages, answer in reward_model.ground_truth. DAPO-Math-17k (split
    # "train", integer answers) and Skywork-OR1-RL-Data (split "math").
    "verl": dict(
        question="prompt.0.content", answer="reward_model.ground_truth", answer_from="json_list",
        strip=[_DAPO_PREFIX, _DAPO_SUFFIX, _BOXED_INSTRUCTION],
        hub_ids=["BytedTsinghua-SIA/DAPO-Math-17k", "Skywork/Skywork-OR1-RL-Data"],
        # Not checked: Skywork's ground_truth is a JSON-encoded list (its preprocessing json.loads it; we keep the
        # first entry), and the exact instruction text around its problems (a trailing \boxed{} request is removed).
    ),
    # open-r1's deduplicated DAPO: prompt = the wrapped problem as text, answer in "solution".
    "dapo_processed": dict(
        question="prompt", answer="solution", answer_from="text", strip=[_DAPO_PREFIX, _DAPO_SUFFIX],
        hub_ids=["open-r1/DAPO-Math-17k-Processed"], config="en",
    ),
    # opencompass/AIME2025 (configs AIME2025-I / AIME2025-II, split "test"). Not checked: the column names.
    "question_answer": dict(question="question", answer="answer", answer_from="text",
                            hub_ids=["opencompass/AIME2025"], config="AIME2025-I"),
    # Prompts that are already chat messages (a conversation, few-shot turns included) + an "answer" column: kept as
    # they are, no instruction added (bapo_trl.recipes.math_reasoning.chat_arithmetic).
    # A plain-text prompt gets the instruction as usual.
    "chat": dict(question="prompt", answer="answer", answer_from="text", hub_ids=[], chat=True),
}

#: Familiar names for the formats above.
ALIASES = {"dapo": "verl", "skywork": "verl", "aime": "problem_answer", "math500": "problem_answer"}


def _after_hashes(text: str) -> str:
    return text.rsplit("####", 1)[1].strip().replace(",", "") if "####" in text else text.strip()


def _json_list(text: str) -> str:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return text
    return str(value[0]) if isinstance(value, list) and value else str(value)


EXTRACTORS = {
    "text": lambda text: text.strip(),
    "after_hashes": _after_hashes,
    "last_boxed": lambda text: last_boxed(text) or "",
    "json_list": _json_list,
}


def get_path(row: dict, path: str):
    """``row["a"]["b"]`` for ``"a.b"``; integer parts index lists (``"prompt.0.content"``)."""
    value = row
    for part in path.split("."):
        value = value[int(part)] if isinstance(value, (list, tuple)) else value[part]
    return value


def _top_column(path: str) -> str:
    return path.split(".", 1)[0]


def format_for_id(dataset_name: str | None) -> str | None:
    """The format whose ``hub_ids`` list ``dataset_name`` (case-insensitive), or ``None``."""
    name = (dataset_name or "").lower().rstrip("/")
    for fmt, spec in MATH_FORMATS.items():
        if any(name == hub_id.lower() for hub_id in spec["hub_ids"]):
            return fmt
    return None


def resolve_format(fmt: str, dataset_name: str | None = None, column_names: list[str] | None = None) -> str:
    """A format name from a name, an alias, or ``"auto"`` (the dataset id first, then the columns present)."""
    fmt = ALIASES.get(fmt, fmt)
    if fmt in MATH_FORMATS:
        return fmt
    if fmt != "auto":
        raise ValueError(f"Unknown `math_dataset_format` {fmt!r}: use 'auto' or one of "
                         f"{sorted(MATH_FORMATS) + sorted(ALIASES)}.")
    found = format_for_id(dataset_name)
    if found:
        return found
    columns = set(column_names or [])
    for name, spec in MATH_FORMATS.items():
        if {_top_column(spec["question"]), _top_column(spec["answer"])} <= columns:
            return name
    raise ValueError(
        f"Cannot tell the math format of dataset {dataset_name!r} (columns {sorted(columns)}): pass "
        f"--math_dataset_format with one of {sorted(MATH_FORMATS)}, or add an entry to "
        "bapo_trl.recipes.math_reasoning.data.MATH_FORMATS."
    )


def default_config(dataset_name: str | None) -> str | None:
    """The hub config a known dataset needs when none is given (GSM8K: ``main``)."""
    fmt = format_for_id(dataset_name)
    return MATH_FORMATS[fmt].get("config") if fmt else None


def make_prompt(problem: str, instruction_role: str = "system", instruction: str = SYSTEM_PROMPT) -> list[dict]:
    """Chat messages for one problem, the boxed-answer instruction as a system message or after the problem."""
    if instruction_role == "system":
        return [{"role": "system", "content": instruction}, {"role": "user", "content": problem}]
    if instruction_role == "user":
        return [{"role": "user", "content": f"{problem}\n\n{instruction}"}]
    raise ValueError(f"`math_instruction_role` must be 'system' or 'user', got {instruction_role!r}.")


def to_math_prompts(dataset, fmt: str = "auto", dataset_name: str | None = None, instruction_role: str = "system",
                    instruction: str = SYSTEM_PROMPT):
    """``dataset`` with exactly two columns, ``prompt`` (chat messages) and ``answer`` (text)."""
    name = resolve_format(fmt, dataset_name, dataset.column_names)
    spec = MATH_FORMATS[name]
    missing = {_top_column(spec["question"]), _top_column(spec["answer"])} - set(dataset.column_names)
    if missing:
        raise ValueError(f"Dataset {dataset_name!r} has no column(s) {sorted(missing)} needed by math format "
                         f"{name!r}; its columns are {dataset.column_names}.")
    strip = [re.compile(pattern) for pattern in spec.get("strip", [])]
    extract = EXTRACTORS[spec["answer_from"]]
    make_prompt(" ", instruction_role)  # a bad role fails here, not inside datasets.map

    def convert(row):
        if spec.get("chat") and isinstance(row[spec["question"]], list):
            return {"prompt": [{"role": m["role"], "content": m["content"]} for m in row[spec["question"]]],
                    "answer": extract(str(get_path(row, spec["answer"])))}
        problem = str(get_path(row, spec["question"]))
        for pattern in strip:
            problem = pattern.sub("", problem)
        return {"prompt": make_prompt(problem.strip(), instruction_role, instruction),
                "answer": extract(str(get_path(row, spec["answer"])))}

    return dataset.map(convert, remove_columns=dataset.column_names, desc=f"math format {name!r}")
