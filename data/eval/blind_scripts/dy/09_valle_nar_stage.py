"""VALL-E stage 2 (NAR): predict codebooks 2..8 in parallel given phonemes, the acoustic
prompt and the lower codebooks of the target. One stage is sampled per batch.

    torchrun --nproc_per_node=8 09_valle_nar_stage.py --config conf/nar_base.json
"""
import argparse
import json
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("nar")

DEFAULTS = dict(
    data_root="/datasets/tts/mls_en_codes",
    out_dir="/shared/exp/valle_nar",
    n_q=8, card=1024, n_phones=256,
    dim=1024, heads=16, layers=12,
    batch_size=16, lr=3e-4, warmup_steps=4000, epochs=25,
    prompt_min=75, prompt_max=225,
    num_workers=6, log_every=100, seed=7,
)


class NARSet(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, f"{split}.jsonl")) as f:
            self.items = [json.loads(l) for l in f]
        self.root = root

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        codes = torch.from_numpy(np.load(os.path.join(self.root, it["codes"])).astype(np.int64))  # [8, T]
        prompt = torch.from_numpy(np.load(os.path.join(self.root, it["prompt_codes"])).astype(np.int64))
        return torch.tensor(it["phones"]), prompt.T, codes.T


def collate(batch):
    phones, prompts, codes = zip(*batch)
    lens = lambda xs: torch.tensor([x.shape[0] for x in xs])
    return (pad_sequence(phones, True), lens(phones), pad_sequence(prompts, True), lens(prompts),
            pad_sequence(codes, True), lens(codes))


class AdaLN(nn.Module):
    def __init__(self, dim, n_stages):
        super().__init__()
        self.ln = nn.LayerNorm(dim, elementwise_affine=False)
        self.mod = nn.Embedding(n_stages, 2 * dim)
        nn.init.zeros_(self.mod.weight)

    def forward(self, x, stage):
        scale, shift = self.mod(stage)[:, None].chunk(2, -1)
        return self.ln(x) * (1 + scale) + shift


class NARLayer(nn.Module):
    def __init__(self, dim, heads, n_stages):
        super().__init__()
        self.n1, self.n2 = AdaLN(dim, n_stages), AdaLN(dim, n_stages)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))

    def forward(self, x, stage, pad):
        h = self.n1(x, stage)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        return x + self.ff(self.n2(x, stage))


class ValleNAR(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_q, self.card = c["n_q"], c["card"]
        self.phone_emb = nn.Embedding(c["n_phones"], c["dim"])
        # one table for all codebooks: index = level * card + code
        self.code_emb = nn.Embedding(self.n_q * self.card, c["dim"])
        self.pos = nn.Embedding(4096, c["dim"])
        self.layers = nn.ModuleList(NARLayer(c["dim"], c["heads"], self.n_q) for _ in range(c["layers"]))
        self.out_norm = AdaLN(c["dim"], self.n_q)
        self.head = nn.Linear(c["dim"], self.card)

    def embed_codes(self, codes, upto):
        offs = torch.arange(upto, device=codes.device) * self.card
        return self.code_emb(codes[..., :upto] + offs).sum(-2)

    def forward(self, phones, plen, prompt, prlen, codes, clen, stage):
        # prompt sees all 8 levels, target sees levels < stage
        xp = self.phone_emb(phones)
        xr = self.embed_codes(prompt, self.n_q)
        xt = self.embed_codes(codes, stage)
        x = torch.cat([xp, xr, xt], 1)
        x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        ar = torch.arange(x.shape[1], device=x.device)
        tp, tr = phones.shape[1], prompt.shape[1]
        pad = torch.cat([ar[None, :tp] >= plen[:, None], ar[None, :tr] >= prlen[:, None],
                         ar[None, : codes.shape[1]] >= clen[:, None]], 1)
        st = torch.full((x.shape[0],), stage, device=x.device, dtype=torch.long)
        for layer in self.layers:
            x = layer(x, st, pad)
        x = self.out_norm(x, st)
        return self.head(x[:, tp + tr :])


def nar_step(model, batch, stage, device):
    phones, plen, prompt, prlen, codes, clen = [t.to(device, non_blocking=True) for t in batch]
    logits = model(phones, plen, prompt, prlen, codes, clen, stage)
    target = codes[..., stage].masked_fill(torch.arange(codes.shape[1], device=device)[None] >= clen[:, None], -100)
    return F.cross_entropy(logits.transpose(1, 2).float(), target)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    c = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            c.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(c["seed"])
    stage_rng = random.Random(c["seed"])  # same stage on every rank

    train_ds, valid_ds = NARSet(c["data_root"], "train"), NARSet(c["data_root"], "valid")
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=c["seed"])
    train_dl = DataLoader(train_ds, batch_size=c["batch_size"], sampler=train_sampler, collate_fn=collate,
                          num_workers=c["num_workers"], pin_memory=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=c["batch_size"], sampler=valid_sampler, collate_fn=collate,
                          num_workers=2)

    model = DDP(ValleNAR(c).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=c["lr"], total_steps=c["epochs"] * len(train_dl),
                                                pct_start=c["warmup_steps"] / (c["epochs"] * len(train_dl)))
    start_epoch = 0
    ckpt = os.path.join(c["out_dir"], "nar_last.pt")
    if a.resume and os.path.exists(ckpt):
        st = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        stage_rng.setstate(st["stage_rng"])
        start_epoch = st["epoch"] + 1

    for epoch in range(start_epoch, c["epochs"]):
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_dl):
            stage = stage_rng.randint(1, c["n_q"] - 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nar_step(model, batch, stage, device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if it % c["log_every"] == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                logger.info("epoch %d it %d/%d stage %d loss %.4f lr %.2e %.1fs", epoch, it, len(train_dl),
                            stage, l.item(), sched.get_last_lr()[0], time.time() - t0)

        # validation: mean loss over every stage
        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in valid_dl:
                for stage in range(1, c["n_q"]):
                    tot[0] += nar_step(model.module, batch, stage, device)
                    tot[1] += 1
        dist.all_reduce(tot)
        logger.info("epoch %d valid loss %.4f", epoch, (tot[0] / tot[1]).item())

        if rank == 0:
            os.makedirs(c["out_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "stage_rng": stage_rng.getstate(), "epoch": epoch, "config": c}, ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
