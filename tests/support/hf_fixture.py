"""Local copies of the standard benchmarks' dataset repositories, built in a test (nothing is downloaded).

Each copy has the layout `hf download --repo-type dataset REPO --local-dir DIR/REPO` gives: a
README.md whose YAML header lists the configs and their data files, and the data files (parquet
for some, JSON lines for others), so `datasets.load_dataset(DIR/REPO, config, split=...)` reads
it exactly as it reads the real repository.
"""
from __future__ import annotations

import json
from pathlib import Path

# a few rows per benchmark, with the columns the real datasets have
ROWS = {
    "openai/gsm8k": [{"question": f"Tom has {i} apples and buys {i + 3} more. How many now?",
                      "answer": f"#### {2 * i + 3}"} for i in range(12)],
    "HuggingFaceH4/MATH-500": [{"problem": f"Compute ${i}^2 + {i}$.", "solution": "...", "answer": str(i * i + i),
                                "subject": "Algebra", "level": 1, "unique_id": f"test/{i}.json"} for i in range(6)],
    "openai/openai_humaneval": [{"task_id": f"HumanEval/{i}",
                                 "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
                                 "canonical_solution": f"    return x + {i}\n", "test": "", "entry_point": f"f{i}"}
                                for i in range(5)],
    "google-research-datasets/mbpp": [{"source_file": "x", "task_id": i, "prompt": f"Write a function adding {i}.",
                                       "code": "", "test_imports": [], "test_list": []} for i in range(5)],
    "HuggingFaceH4/mt_bench_prompts": [{"prompt": [f"Write a haiku about {w}.", "Now make it rhyme."],
                                        "category": "writing", "reference": []} for w in ("rain", "sun", "snow")],
    "tatsu-lab/alpaca": [{"instruction": "Give three tips for staying healthy.", "input": "", "output": "", "text": ""},
                         {"instruction": "Translate to French.", "input": "Good morning", "output": "", "text": ""}],
}
# (config, split, file format) as the real repositories have them
LAYOUT = {
    "openai/gsm8k": ("main", "test", "parquet"),
    "HuggingFaceH4/MATH-500": (None, "test", "jsonl"),
    "openai/openai_humaneval": ("openai_humaneval", "test", "parquet"),
    "google-research-datasets/mbpp": ("sanitized", "test", "parquet"),
    "HuggingFaceH4/mt_bench_prompts": (None, "train", "jsonl"),
    "tatsu-lab/alpaca": (None, "train", "parquet"),
}


def write_repo(root: Path, repo: str, rows: list[dict] | None = None) -> Path:
    """`root/repo/`: README.md with the configs, and the data file of the benchmark's split."""
    config, split, fmt = LAYOUT[repo]
    rows = ROWS[repo] if rows is None else rows
    d = Path(root) / repo
    sub = config or "data"
    (d / sub).mkdir(parents=True, exist_ok=True)
    _write(d / sub / f"{split}-00000-of-00001.{fmt}", rows, fmt)
    configs = [{"name": config or "default", "dir": sub}]
    if config == "main":  # gsm8k has a second config: the loader must pick the right one
        configs.append({"name": "socratic", "dir": "socratic"})
        (d / "socratic").mkdir(exist_ok=True)
        _write(d / "socratic" / f"{split}-00000-of-00001.{fmt}",
               [{**r, "question": "SOCRATIC " + r["question"]} for r in rows], fmt)
    yaml = "".join(f"- config_name: {c['name']}\n  data_files:\n  - split: {split}\n    path: {c['dir']}/{split}-*\n"
                   for c in configs)
    (d / "README.md").write_text(f"---\nconfigs:\n{yaml}---\n# {repo} (test copy)\n")
    return d


def _write(path: Path, rows: list[dict], fmt: str) -> None:
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_all(root: Path) -> Path:
    for repo in ROWS:
        write_repo(root, repo)
    return Path(root)
