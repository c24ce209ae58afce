"""The assistant for broken PyTorch distributed training.

Stages, one module each: clean (log -> root error), index (KB -> SQLite +
FAISS), retrieve (signals -> ranked causes), runner (probes via torchrun),
verdicts (facts -> verdict per cause), render (terminal output); engine ties
retrieval together, cli and tui are thin front ends.
"""

__version__ = "0.1.0"
