"""Every rank finds the token cache missing and calls the helper that writes it
(a numpy memmap created with mode="w+", and an index with tofile): on the first
run all processes write the same files at once, and a rank can map a half-written one.

torchrun --nproc_per_node=8 token_cache_built_by_a_helper_on_every_rank.py
"""

import os

import numpy as np
import torch
import torch.distributed as dist

CACHE = "cache"


def encode(split):
    return np.arange(1000, dtype=np.uint16) if split == "train" else np.arange(100, dtype=np.uint16)


def write_split(split):
    tokens = encode(split)
    out = np.memmap(
        os.path.join(CACHE, f"{split}.bin"), dtype=np.uint16, mode="w+", shape=tokens.shape
    )
    out[:] = tokens
    out.flush()
    np.array([len(tokens)], dtype=np.int64).tofile(os.path.join(CACHE, f"{split}.idx"))


def build_token_cache():
    os.makedirs(CACHE, exist_ok=True)
    for split in ("train", "val"):
        write_split(split)


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    if not os.path.exists(os.path.join(CACHE, "val.bin")):
        build_token_cache()  # expect: dataset-cache-race
    data = np.memmap(os.path.join(CACHE, "train.bin"), dtype=np.uint16, mode="r")
    print(dist.get_rank(), len(data))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
