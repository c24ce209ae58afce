"""A hyper-parameter search under torchrun: every rank creates its own in-memory Optuna
study and draws its own width and depth, so the ranks build different models and
DDP's construction check fails ("DDP expects same model across all ranks"). Lint
only: optuna is not installed here."""

import os

import optuna
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train_one(cfg: dict, local_rank: int) -> float:
    layers = [nn.Linear(16, cfg["width"]), nn.ReLU()]
    for _ in range(cfg["depth"]):
        layers += [nn.Linear(cfg["width"], cfg["width"]), nn.ReLU()]
    model = DDP(nn.Sequential(*layers, nn.Linear(cfg["width"], 2)).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    loss = torch.zeros(())
    for _ in range(20):
        x, y = torch.randn(32, 16).cuda(), torch.randint(0, 2, (32,)).cuda()
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.all_reduce(loss)
    return loss.item()


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")

    def objective(trial: optuna.Trial) -> float:
        cfg = {
            "width": trial.suggest_int("width", 32, 256, log=True),
            "depth": trial.suggest_int("depth", 1, 4),
            "lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
        }
        return train_one(cfg, local_rank)

    study = optuna.create_study(direction="minimize")  # expect: model-differs-across-ranks
    study.optimize(objective, n_trials=10)
    if dist.get_rank() == 0:
        print(study.best_params)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
