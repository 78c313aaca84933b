"""Tiny lm-evaluation-harness tasks in the harness's local-file format (a task YAML with
`dataset_path: json` and `data_files`), made from any jsonl corpus, so that the adapter can be
tested and demonstrated without the network. Each mirrors a paper task's shape:

- `tiny_lambada`: `loglikelihood` of a sentence's last word (acc, perplexity), as lambada_openai;
- `tiny_piqa`: `multiple_choice` between the true ending and another sentence's (acc, acc_norm);
- `tiny_wikitext`: `loglikelihood_rolling` of whole paragraphs (word/byte perplexity);
- `tiny_gen`: greedy `generate_until` a period, scored by exact match with the next word.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

from megatron_ext.data.readers import iter_lines

__all__ = ["TINY_TASKS", "write_tiny_tasks"]

TINY_TASKS = ("tiny_lambada", "tiny_piqa", "tiny_wikitext", "tiny_gen")

_YAML = {
    "tiny_lambada": """task: tiny_lambada
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
    "tiny_piqa": """task: tiny_piqa
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{goal}}}}"
doc_to_target: label
doc_to_choice: "{{{{[sol1, sol2]}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
    "tiny_wikitext": """task: tiny_wikitext
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{page}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
""",
    "tiny_gen": """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_punctuation: true
    ignore_case: true
metadata:
  version: 1.0
""",
}


def _sentences(jsonl: str) -> Iterator[str]:
    for _, line in iter_lines(jsonl):
        for sentence in json.loads(line)["text"].replace("\n", " ").split(". "):
            words = sentence.strip().rstrip(".").split()
            if len(words) >= 6:
                yield " ".join(words)


def write_tiny_tasks(jsonl: str, directory: str, items: int = 6) -> str:
    """Write the four tasks (YAML + jsonl data, `items` documents each) into `directory`;
    pass it to the harness as `include_path` (tools/evaluate.py lm-eval --include-path)."""
    os.makedirs(directory, exist_ok=True)
    sentences = []
    for sentence in _sentences(jsonl):
        sentences.append(sentence)
        if len(sentences) == 2 * items:
            break
    if len(sentences) < 2 * items:
        raise ValueError(f"{jsonl} has too few sentences for {items} items per task")
    rows = {
        "tiny_lambada": [{"text": s} for s in sentences[:items]],
        "tiny_piqa": [],
        "tiny_wikitext": [{"page": f"{a}. {b}."} for a, b in zip(sentences[::2], sentences[1::2])],
        "tiny_gen": [],
    }
    for i in range(items):
        words, other = sentences[i].split(), sentences[items + i].split()
        half = len(words) // 2
        rows["tiny_piqa"].append(
            {"goal": " ".join(words[:half]), "sol1": " ".join(words[half:]),
             "sol2": " ".join(other[len(other) // 2 :]), "label": 0}
        )  # fmt: skip
        rows["tiny_gen"].append({"question": " ".join(words[:-1]), "answer": words[-1]})
    for task, data in rows.items():
        data_path = os.path.join(directory, f"{task}.jsonl")
        with open(data_path, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in data)
        with open(os.path.join(directory, f"{task}.yaml"), "w", encoding="utf-8") as handle:
            handle.write(_YAML[task].format(data=json.dumps(os.path.abspath(data_path))))
    return directory
