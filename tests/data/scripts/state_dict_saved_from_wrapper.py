"""A recommender trained under torchrun that saves its checkpoints from the
DDP wrapper, then resumes and tests from them with a plain model.

torchrun --nproc_per_node=2 state_dict_saved_from_wrapper.py [--resume last.pt]
ddp_model.state_dict() names every tensor "module.<name>": the resume (before
the wrap) and the test model (never wrapped) both fail in load_state_dict with
Missing key(s) "embed.weight" and Unexpected key(s) "module.embed.weight".
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Recommender(nn.Module):
    def __init__(self, items=500, width=32):
        super().__init__()
        self.embed = nn.Embedding(items, width)
        self.score = nn.Linear(width, items)

    def forward(self, history):
        return self.score(self.embed(history).mean(1))


def test(path, device):
    scorer = Recommender().to(device)
    scorer.load_state_dict(torch.load(path, map_location=device))  # expect: state-dict-module-prefix
    scorer.eval()
    with torch.no_grad():
        print(scorer(torch.randint(0, 500, (2, 10), device=device)).topk(5).indices)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", default="")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    model = Recommender().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device)
        model.load_state_dict(checkpoint["model"])  # expect: state-dict-module-prefix
        optimizer.load_state_dict(checkpoint["optimizer"])
        start = checkpoint["epoch"] + 1
    ddp_model = DDP(model)
    for epoch in range(start, start + 2):
        history = torch.randint(0, 500, (16, 10))
        loss = nn.functional.cross_entropy(ddp_model(history), torch.randint(0, 500, (16,)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if local_rank == 0:
            state = {"model": ddp_model.state_dict(), "optimizer": optimizer.state_dict()}
            state["epoch"] = epoch
            torch.save(state, "last.pt")
            torch.save(ddp_model.state_dict(), "best.pt")
        dist.barrier()
    if local_rank == 0:
        test("best.pt", device)
    del ddp_model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
