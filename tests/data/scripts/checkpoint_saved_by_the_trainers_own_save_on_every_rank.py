"""A trainer class of the file saves the generator and its optimizer in its own
`save(step)`; the loop guards only the log line with the rank, so every rank
runs `model.save(step)` and writes the same two files at once (the KAIR /
BasicSR model-class way of saving)."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class BaseModel:
    def __init__(self, save_dir):
        self.save_dir = save_dir

    def save_network(self, network, label):
        state = network.module.state_dict() if isinstance(network, DDP) else network.state_dict()
        torch.save(state, os.path.join(self.save_dir, f"{label}_G.pth"))  # expect: checkpoint-written-by-every-rank


class PlainModel(BaseModel):
    def __init__(self, save_dir, local_rank):
        super().__init__(save_dir)
        self.net = DDP(torch.nn.Conv2d(3, 3, 3, padding=1).cuda(), device_ids=[local_rank])
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=2e-4)

    def optimize(self, low, high):
        loss = torch.nn.functional.l1_loss(self.net(low), high)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def save(self, step):
        self.save_network(self.net, step)
        torch.save(self.optimizer.state_dict(), os.path.join(self.save_dir, f"{step}_opt.pth"))  # expect: checkpoint-written-by-every-rank


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = PlainModel("experiments", local_rank)
    for step in range(1, 1001):
        low = torch.randn(4, 3, 32, 32, device="cuda")
        loss = model.optimize(low, low)
        if step % 500 == 0:
            if dist.get_rank() == 0:
                print(f"step {step} loss {loss:.4f}")
            model.save(step)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
