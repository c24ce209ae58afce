"""
Small pairwise reward model (DeBERTa-v3-large) used as a fast filter before the big RM.

torchrun --nproc_per_node=4 13_deberta_pairwise_rm.py --config configs/rm_small.yaml
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

DEFAULT_CFG = {
    "model": "microsoft/deberta-v3-large",
    "train_file": "data/hh_pairs_train.jsonl",
    "val_file": "data/hh_pairs_val.jsonl",
    "max_len": 512,
    "batch_size": 8,
    "lr": 1e-5,
    "epochs": 2,
    "warmup_ratio": 0.1,
    "eval_every": 500,
    "out_dir": "ckpt/rm_small",
}


class PairDataset(Dataset):
    def __init__(self, path):
        self.rows = [json.loads(l) for l in open(path)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return r["prompt"], r["chosen"], r["rejected"]


class PairCollate:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, batch):
        prompts = [b[0] for b in batch] * 2
        resps = [b[1] for b in batch] + [b[2] for b in batch]
        return self.tok(prompts, resps, truncation="only_first", max_length=self.max_len,
                        padding=True, return_tensors="pt")


class RewardModel(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name)
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(self.enc.config.hidden_size, 1))

    def forward(self, **enc):
        h = self.enc(**enc).last_hidden_state[:, 0]
        return self.head(h).squeeze(-1)


def bt_loss(scores):
    half = scores.size(0) // 2
    diff = scores[:half] - scores[half:]
    return -F.logsigmoid(diff).mean(), diff


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    n_correct, n_total, loss_sum = 0, 0, 0.0
    for enc in loader:
        enc = {k: v.to(device) for k, v in enc.items()}
        loss, diff = bt_loss(model(**enc).float())
        n_correct += (diff > 0).sum().item()
        n_total += diff.numel()
        loss_sum += loss.item() * diff.numel()
    model.train()
    return n_correct / max(n_total, 1), loss_sum / max(n_total, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if args.config:
        cfg.update(yaml.safe_load(open(args.config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(cfg["model"])
    model = RewardModel(cfg["model"]).to(device)
    model = DDP(model, device_ids=[local_rank])

    collate = PairCollate(tok, cfg["max_len"])
    train_ds, val_ds = PairDataset(cfg["train_file"]), PairDataset(cfg["val_file"])
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler, collate_fn=collate,
                          num_workers=4, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=cfg["batch_size"] * 2, sampler=val_sampler, collate_fn=collate,
                        num_workers=4)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    total = len(train_dl) * cfg["epochs"]
    sched = get_linear_schedule_with_warmup(opt, int(cfg["warmup_ratio"] * total), total)
    writer = SummaryWriter(os.path.join(cfg["out_dir"], "tb")) if rank == 0 else None

    best_acc, step = 0.0, 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for enc in train_dl:
            enc = {k: v.to(device, non_blocking=True) for k, v in enc.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                scores = model(**enc)
            loss, diff = bt_loss(scores.float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 50 == 0:
                t = torch.stack([loss.detach(), (diff > 0).float().mean()])
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", t[0].item(), step)
                    writer.add_scalar("train/acc", t[1].item(), step)
                    print(f"[{epoch}:{step}] loss {t[0]:.4f} acc {t[1]:.3f} {(time.time() - t0) / 50:.2f}s/it")
                t0 = time.time()

            if step % cfg["eval_every"] == 0:
                acc, vloss = evaluate(model, val_dl, device)
                if rank == 0:
                    writer.add_scalar("val/acc", acc, step)
                    writer.add_scalar("val/loss", vloss, step)
                    print(f"  val acc {acc:.4f} loss {vloss:.4f} (best {best_acc:.4f})")
                    if acc > best_acc:
                        best_acc = acc
                        os.makedirs(cfg["out_dir"], exist_ok=True)
                        torch.save(model.module.state_dict(), os.path.join(cfg["out_dir"], "best.pt"))
                dist.barrier()

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(cfg["out_dir"], "last.pt"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
