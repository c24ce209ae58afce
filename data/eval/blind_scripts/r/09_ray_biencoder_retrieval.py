"""Query -> product bi-encoder (shared DistilBERT tower), in-batch negatives.

Ray Train on the 4 x A10G node:
    python 09_ray_biencoder_retrieval.py --num-workers 4 --train data/pairs_train.jsonl --dev data/pairs_dev.jsonl
"""
import argparse
import json
import os
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

import ray
import ray.train
import ray.train.torch
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


class Pairs(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return r["query"], r["title"] + " | " + r.get("description", "")[:512]


class Encoder(torch.nn.Module):
    def __init__(self, name, dim=256):
        super().__init__()
        self.bert = AutoModel.from_pretrained(name)
        self.proj = torch.nn.Linear(self.bert.config.hidden_size, dim)

    def encode(self, input_ids, attention_mask):
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-6)
        return F.normalize(self.proj(pooled), dim=-1)

    def forward(self, q_ids, q_mask, d_ids, d_mask):
        # both towers in one call so DDP sees a single forward per step
        return self.encode(q_ids, q_mask), self.encode(d_ids, d_mask)


def make_collate(tokenizer, q_len=32, d_len=128):
    def collate(batch):
        qs, ds = zip(*batch)
        q = tokenizer(list(qs), padding=True, truncation=True, max_length=q_len, return_tensors="pt")
        d = tokenizer(list(ds), padding=True, truncation=True, max_length=d_len, return_tensors="pt")
        return q["input_ids"], q["attention_mask"], d["input_ids"], d["attention_mask"]
    return collate


@torch.no_grad()
def recall_at_k(net, loader, device, ks=(1, 10)):
    net.eval()
    qe, de = [], []
    for qi, qm, di, dm in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            q, d = net(qi.to(device), qm.to(device), di.to(device), dm.to(device))
            qe.append(q.float())
            de.append(d.float())
    qe, de = torch.cat(qe), torch.cat(de)
    ranks = (qe @ de.T).argsort(dim=1, descending=True)
    gold = torch.arange(len(qe), device=device).unsqueeze(1)
    net.train()
    return {f"recall@{k}": (ranks[:, :k] == gold).any(1).float().mean().item() for k in ks}


def train_loop_per_worker(cfg):
    ctx = ray.train.get_context()
    device = ray.train.torch.get_device()
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    collate = make_collate(tokenizer)

    train_loader = DataLoader(Pairs(cfg["train"]), batch_size=cfg["batch_size"], shuffle=True,
                              drop_last=True, num_workers=4, collate_fn=collate)
    train_loader = ray.train.torch.prepare_data_loader(train_loader)
    # dev set is small: every worker scores the full set with the plain module
    dev_loader = DataLoader(Pairs(cfg["dev"]), batch_size=256, collate_fn=collate)

    model = ray.train.torch.prepare_model(Encoder(cfg["model"]))
    net = model.module if hasattr(model, "module") else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    total = cfg["epochs"] * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total), total)
    scaler = torch.cuda.amp.GradScaler()

    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            st = torch.load(os.path.join(d, "state.pt"), map_location="cpu")
        net.load_state_dict(st["model"])
        optimizer.load_state_dict(st["optimizer"])
        scheduler.load_state_dict(st["scheduler"])
        scaler.load_state_dict(st["scaler"])
        start = st["epoch"] + 1

    for epoch in range(start, cfg["epochs"]):
        if ctx.get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for qi, qm, di, dm in train_loader:
            with torch.autocast("cuda", dtype=torch.float16):
                q, d = model(qi, qm, di, dm)
                logits = (q @ d.T).float() / cfg["temperature"]
                labels = torch.arange(q.size(0), device=device)
                loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])

        if ctx.get_world_size() > 1:
            torch.distributed.all_reduce(loss_sum)
        metrics = {"epoch": epoch, "loss": (loss_sum[0] / loss_sum[1]).item()}
        metrics.update(recall_at_k(net, dev_loader, device))

        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if ctx.get_world_rank() == 0:
                torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                            "epoch": epoch}, os.path.join(tmp, "state.pt"))
                checkpoint = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="distilbert-base-uncased")
    ap.add_argument("--train", default="data/pairs_train.jsonl")
    ap.add_argument("--dev", default="data/pairs_dev.jsonl")
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--temperature", type=float, default=0.05)
    ap.add_argument("--storage", default="/shared/ray_results")
    args = ap.parse_args()

    ray.init()
    cfg = {"model": args.model, "train": os.path.abspath(args.train), "dev": os.path.abspath(args.dev),
           "batch_size": args.batch_size, "epochs": args.epochs, "lr": args.lr,
           "temperature": args.temperature}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=True),
        run_config=RunConfig(name="biencoder", storage_path=args.storage,
                             checkpoint_config=CheckpointConfig(num_to_keep=2,
                                                                checkpoint_score_attribute="recall@10",
                                                                checkpoint_score_order="max")),
    )
    result = trainer.fit()
    print(result.metrics)


if __name__ == "__main__":
    main()
