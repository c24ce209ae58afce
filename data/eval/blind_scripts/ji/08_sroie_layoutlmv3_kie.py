"""SROIE receipt KIE (company / date / address / total) with LayoutLMv3, resumable.

Input jsonl (one receipt per line, produced by tools/sroie_to_jsonl.py):
    {"image": "...jpg", "width": W, "height": H, "words": [...], "boxes": [[x0,y0,x1,y1],...], "labels": [...]}

    torchrun --nproc_per_node=4 08_sroie_layoutlmv3_kie.py --resume runs/sroie/ckpt_last.pt
"""
import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from PIL import Image
from seqeval.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMv3ForTokenClassification, LayoutLMv3Processor

TAGS = ["O", "B-COMPANY", "I-COMPANY", "B-DATE", "I-DATE", "B-ADDRESS", "I-ADDRESS", "B-TOTAL", "I-TOTAL"]


@dataclass
class Config:
    train_file: str = "data/sroie/train.jsonl"
    test_file: str = "data/sroie/test.jsonl"
    model: str = "microsoft/layoutlmv3-base"
    out_dir: str = "runs/sroie"
    epochs: int = 30
    batch_size: int = 4
    lr: float = 2e-5
    max_len: int = 512
    grad_accum: int = 2
    resume: str = ""
    save_every: int = 1


def get_config():
    ap = argparse.ArgumentParser()
    for f in dataclasses.fields(Config):
        ap.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    return Config(**vars(ap.parse_args()))


class SroieDataset(Dataset):
    def __init__(self, path, processor, max_len):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.processor = processor
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        w, h = r["width"], r["height"]
        boxes = [[min(1000, max(0, int(1000 * v / s))) for v, s in zip(b, (w, h, w, h))] for b in r["boxes"]]
        image = Image.open(r["image"]).convert("RGB")
        enc = self.processor(image, r["words"], boxes=boxes, word_labels=[TAGS.index(t) for t in r["labels"]],
                             truncation=True, padding="max_length", max_length=self.max_len, return_tensors="pt")
        return {k: v.squeeze(0) for k, v in enc.items()}


class KIETrainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0

        self.processor = LayoutLMv3Processor.from_pretrained(cfg.model, apply_ocr=False)
        self.train_ds = SroieDataset(cfg.train_file, self.processor, cfg.max_len)
        self.test_ds = SroieDataset(cfg.test_file, self.processor, cfg.max_len)
        self.sampler = DistributedSampler(self.train_ds, shuffle=True)
        self.train_dl = DataLoader(self.train_ds, batch_size=cfg.batch_size, sampler=self.sampler,
                                   num_workers=4, pin_memory=True, drop_last=True)
        shard = list(range(self.rank, len(self.test_ds), self.world))
        self.test_dl = DataLoader(torch.utils.data.Subset(self.test_ds, shard), batch_size=cfg.batch_size,
                                  num_workers=4)

        net = LayoutLMv3ForTokenClassification.from_pretrained(
            cfg.model, num_labels=len(TAGS), id2label=dict(enumerate(TAGS)),
            label2id={t: i for i, t in enumerate(TAGS)})
        self.model = DDP(net.to(self.device), device_ids=[self.local_rank])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.01)
        updates = cfg.epochs * len(self.train_dl) // cfg.grad_accum
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / 200) * max(0.0, 1 - s / updates))
        self.start_epoch = 0
        self.best_f1 = 0.0
        if cfg.resume:
            self.load(cfg.resume)

    def save(self, path):
        torch.save({
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epoch": self.epoch,
            "best_f1": self.best_f1,
            "config": dataclasses.asdict(self.cfg),
        }, path)

    def load(self, path):
        state = torch.load(path)
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.start_epoch = state["epoch"] + 1
        self.best_f1 = state["best_f1"]
        if self.is_main:
            print(f"resumed from {path}: epoch {self.start_epoch}, best F1 {self.best_f1:.4f}", flush=True)

    @torch.no_grad()
    def evaluate(self):
        net = self.model.module
        net.eval()
        y_true, y_pred = [], []
        for batch in self.test_dl:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            logits = net(**batch).logits
            for p_row, l_row in zip(logits.argmax(-1).tolist(), batch["labels"].tolist()):
                y_true.append([TAGS[l] for l in l_row if l != -100])
                y_pred.append([TAGS[p] for p, l in zip(p_row, l_row) if l != -100])
        parts = [None] * self.world
        dist.all_gather_object(parts, (y_true, y_pred))
        net.train()
        all_true = [s for t, _ in parts for s in t]
        all_pred = [s for _, p in parts for s in p]
        return f1_score(all_true, all_pred)

    def train(self):
        cfg = self.cfg
        os.makedirs(cfg.out_dir, exist_ok=True)
        for self.epoch in range(self.start_epoch, cfg.epochs):
            self.sampler.set_epoch(self.epoch)
            self.model.train()
            t0 = time.time()
            for i, batch in enumerate(self.train_dl):
                batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
                last_micro = (i + 1) % cfg.grad_accum == 0
                if last_micro:
                    loss = self.model(**batch).loss / cfg.grad_accum
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                else:
                    with self.model.no_sync():
                        loss = self.model(**batch).loss / cfg.grad_accum
                        loss.backward()
            f1 = self.evaluate()
            if self.is_main:
                print(f"epoch {self.epoch}: last loss {loss.item() * cfg.grad_accum:.4f} test F1 {f1:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                if f1 > self.best_f1:
                    self.best_f1 = f1
                    self.model.module.save_pretrained(os.path.join(cfg.out_dir, "best"))
                if (self.epoch + 1) % cfg.save_every == 0:
                    self.save(os.path.join(cfg.out_dir, "ckpt_last.pt"))
            self.best_f1 = max(self.best_f1, f1)
            dist.barrier()

    def close(self):
        dist.destroy_process_group()


def main():
    cfg = get_config()
    trainer = KIETrainer(cfg)
    trainer.train()
    trainer.close()


if __name__ == "__main__":
    main()
