"""`runtime plan`: the train step compiled for a TPU, GPU or CPU target this machine need not
have (`targets.py`), its memory, FLOPs and collectives per chip (`compile.py`, `hlo.py`)."""
