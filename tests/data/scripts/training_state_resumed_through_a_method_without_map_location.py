"""Every rank reads the last training state (optimizer and scheduler state
saved from cuda:0) without map_location and hands it to the trainer's own
resume method, which loads it into the optimizer and the scheduler: each rank
first puts the whole state on cuda:0 (the BasicSR way of resuming)."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, local_rank):
        self.net = DDP(torch.nn.Linear(512, 512).cuda(), device_ids=[local_rank])
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=1e-4)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 1000)

    def resume_training(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state["iter"]

    def save_state(self, path, step):
        state = {
            "iter": step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        torch.save(state, path)

    def step(self, batch):
        loss = self.net(batch).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    trainer = Trainer(local_rank)
    start = 0
    if os.path.exists("last.state"):
        resume_state = torch.load("last.state")  # expect: checkpoint-map-location
        start = trainer.resume_training(resume_state)
    for step in range(start, start + 100):
        trainer.step(torch.randn(16, 512, device="cuda"))
        if dist.get_rank() == 0 and step % 50 == 0:
            trainer.save_state("last.state", step)
    del trainer  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
