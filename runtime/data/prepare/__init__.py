"""The prepare side of the data: input files (text, JSONL, parquet, rollout JSONL; plain or
compressed, local or gs://) turned into token shards, document offsets and a manifest.json
(`runtime data prepare|merge|tokenizer`, a prepare job, a run's `[data.prepare]`).

Training never imports this package to read a dataset: the read side (runtime/data/manifest.py,
loader.py, mixture.py) loads it only when a run has to make its dataset first.
"""
