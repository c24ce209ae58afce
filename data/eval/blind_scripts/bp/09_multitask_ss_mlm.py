"""Joint training of a protein encoder on masked-LM (UniRef sample) and 8-state secondary
structure (NetSurfP-2.0 training set), alternating task batches.

    torchrun --nproc_per_node=8 09_multitask_ss_mlm.py --cfg configs/multitask.json
"""
import argparse
import itertools
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import EsmModel, EsmTokenizer

SS8 = "GHIBESTC"


@dataclass
class Cfg:
    backbone: str = "facebook/esm2_t12_35M_UR50D"
    mlm_npy: str = "data/uniref_sample_seqs.npy"
    ss_train: str = "data/netsurfp_train.npz"
    ss_valid: str = "data/cb513.npz"
    out_dir: str = "runs/multitask"
    batch_size: int = 16
    max_len: int = 512
    lr: float = 5e-5
    head_lr: float = 1e-3
    steps: int = 40000
    ss_every: int = 2
    eval_every: int = 1000


class MLMSeqs(Dataset):
    def __init__(self, path):
        self.seqs = np.load(path, allow_pickle=True).tolist()

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], None


class SSData(Dataset):
    def __init__(self, path):
        d = np.load(path, allow_pickle=True)
        self.seqs, self.ss = d["seqs"].tolist(), d["ss8"].tolist()

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], self.ss[i]


class Collator:
    def __init__(self, tok, max_len, mlm_prob=0.15):
        self.tok, self.max_len, self.p = tok, max_len, mlm_prob

    def __call__(self, batch):
        seqs, ss = zip(*batch)
        enc = self.tok(list(seqs), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        ids = enc["input_ids"]
        if ss[0] is None:
            labels = ids.clone()
            m = (torch.rand(ids.shape) < self.p) & (ids > 3) & (ids < 24)
            labels[~m] = -100
            ids = ids.masked_fill(m, self.tok.mask_token_id)
            return {"input_ids": ids, "attention_mask": enc["attention_mask"], "labels": labels, "task": "mlm"}
        labels = torch.full(ids.shape, -100, dtype=torch.long)
        for k, s in enumerate(ss):
            s = s[: ids.shape[1] - 2]
            labels[k, 1:1 + len(s)] = torch.tensor([SS8.index(c) for c in s])
        return {"input_ids": ids, "attention_mask": enc["attention_mask"], "labels": labels, "task": "ss"}


class MultiTaskModel(nn.Module):
    def __init__(self, backbone, vocab_size):
        super().__init__()
        self.encoder = EsmModel.from_pretrained(backbone, add_pooling_layer=False)
        self.encoder.contact_head.requires_grad_(False)
        h = self.encoder.config.hidden_size
        self.mlm_head = nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.LayerNorm(h), nn.Linear(h, vocab_size))
        self.ss_head = nn.Sequential(nn.Dropout(0.1), nn.Linear(h, h // 2), nn.ReLU(), nn.Linear(h // 2, len(SS8)))

    def forward(self, input_ids, attention_mask, task):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.mlm_head(h) if task == "mlm" else self.ss_head(h)


def infinite(loader, sampler):
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


@torch.no_grad()
def eval_q8(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for b in loader:
        logits = model(b["input_ids"].to(device), b["attention_mask"].to(device), "ss")
        y = b["labels"].to(device)
        m = y != -100
        c[0] += (logits.argmax(-1)[m] == y[m]).sum()
        c[1] += m.sum()
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    a = ap.parse_args()
    cfg = Cfg(**json.load(open(a.cfg))) if a.cfg else Cfg()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    tok = EsmTokenizer.from_pretrained(cfg.backbone)
    col = Collator(tok, cfg.max_len)
    mlm_ds, ss_ds, ss_val = MLMSeqs(cfg.mlm_npy), SSData(cfg.ss_train), SSData(cfg.ss_valid)
    mlm_s = DistributedSampler(mlm_ds, shuffle=True, seed=0)
    ss_s = DistributedSampler(ss_ds, shuffle=True, seed=0)
    mlm_loader = DataLoader(mlm_ds, cfg.batch_size, sampler=mlm_s, collate_fn=col, num_workers=4, drop_last=True)
    ss_loader = DataLoader(ss_ds, cfg.batch_size, sampler=ss_s, collate_fn=col, num_workers=4, drop_last=True)
    val_loader = DataLoader(ss_val, cfg.batch_size, sampler=DistributedSampler(ss_val, shuffle=False),
                            collate_fn=col, num_workers=2)

    model = MultiTaskModel(cfg.backbone, tok.vocab_size).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    enc_params = [p for n, p in model.named_parameters() if n.startswith("module.encoder.")]
    head_params = [p for n, p in model.named_parameters() if not n.startswith("module.encoder.")]
    opt = torch.optim.AdamW([{"params": enc_params, "lr": cfg.lr}, {"params": head_params, "lr": cfg.head_lr}],
                            weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000) * max(0.0, 1 - s / cfg.steps))

    mlm_it, ss_it = infinite(mlm_loader, mlm_s), infinite(ss_loader, ss_s)
    best = 0.0
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
    for step in range(1, cfg.steps + 1):
        batch = next(ss_it) if step % cfg.ss_every == 0 else next(mlm_it)
        task = batch["task"]
        ids, am, y = batch["input_ids"].to(device), batch["attention_mask"].to(device), batch["labels"].to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, am, task)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()

        if rank == 0 and step % 100 == 0:
            print(f"step {step} {task} loss {loss.item():.4f}", flush=True)
        if step % cfg.eval_every == 0:
            q8 = eval_q8(model, val_loader, device)
            if rank == 0:
                print(f"step {step} CB513 Q8 {q8:.4f}", flush=True)
                if q8 > best:
                    best = q8
                    torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
