"""A module per observation key, registered walking a set of the keys (model-differs-across-ranks).

Python salts string hashes per process, so each rank walks the set in its own
order: the per-key layers, each sized by its key, land at other places, and
DDP's construction check sees other shapes on each rank and fails.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SIZES = {"joint_pos": 7, "joint_vel": 7, "eef_pos": 3, "eef_quat": 4, "gripper_qpos": 2,
         "object": 10, "robot0_eef_vel": 6, "cube_pos": 5}  # fmt: skip


class Encoders(nn.Module):
    def __init__(self, keys, sizes):
        super().__init__()
        self.keys = list(keys)
        layers = {k: nn.Linear(sizes[k], 4) for k in keys}
        self.per_key = nn.ModuleDict(layers)  # expect: model-differs-across-ranks

    def forward(self, batch):
        return sum(self.per_key[k](batch[k]) for k in self.keys)


def main() -> None:
    dist.init_process_group("gloo")
    keys = {k for k in SIZES if k != "object"}
    model = DDP(Encoders(keys, SIZES))
    batch = {k: torch.randn(2, n) for k, n in SIZES.items()}
    model(batch).sum().backward()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
