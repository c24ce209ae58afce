"""Transformer NMT trainer with a binarized-corpus cache.

Raw text is encoded with SentencePiece once and cached as int32 tensors next to the
data, so later runs (and sweeps) skip the slow encoding step.

torchrun --nnodes=1 --nproc_per_node=8 03_binarized_cache_nmt.py --config configs/iwslt_deen.yaml
"""
import argparse
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


@dataclass
class Config:
    data_dir: str = "data/iwslt14.de-en"
    cache_dir: str = "data/iwslt14.de-en/bin"
    spm_model: str = "data/iwslt14.de-en/spm10k.model"
    src: str = "de"
    tgt: str = "en"
    out_dir: str = "exp/iwslt_deen"
    batch_size: int = 128
    accum_steps: int = 2
    max_len: int = 200
    epochs: int = 60
    lr: float = 5e-4
    warmup: int = 4000
    d_model: int = 512
    ffn: int = 1024
    heads: int = 4
    layers: int = 6
    dropout: float = 0.3
    label_smoothing: float = 0.1
    valid_splits: list = field(default_factory=lambda: ["valid", "test"])


def load_config(path):
    with open(path) as f:
        return Config(**yaml.safe_load(f))


def binarize(path, sp, max_len, add_bos):
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            ids = sp.encode(line.strip())[: max_len - 2]
            ids = ([BOS_ID] if add_bos else []) + ids + [EOS_ID]
            out.append(torch.tensor(ids, dtype=torch.int32))
    return out


def load_split(cfg, split, sp):
    cache = os.path.join(cfg.cache_dir, f"{split}.{cfg.src}-{cfg.tgt}.pt")
    if os.path.exists(cache):
        return torch.load(cache, map_location="cpu")
    src = binarize(os.path.join(cfg.data_dir, f"{split}.{cfg.src}"), sp, cfg.max_len, add_bos=False)
    tgt = binarize(os.path.join(cfg.data_dir, f"{split}.{cfg.tgt}"), sp, cfg.max_len, add_bos=True)
    data = {"src": src, "tgt": tgt}
    os.makedirs(cfg.cache_dir, exist_ok=True)
    torch.save(data, cache)
    return data


class BinDataset(Dataset):
    def __init__(self, data):
        self.src, self.tgt = data["src"], data["tgt"]

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return i, self.src[i].long(), self.tgt[i].long()


def collate(batch):
    idx = torch.tensor([b[0] for b in batch])
    src = nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=PAD_ID)
    tgt = nn.utils.rnn.pad_sequence([b[2] for b in batch], batch_first=True, padding_value=PAD_ID)
    return idx, src, tgt


class NMTModel(nn.Module):
    def __init__(self, vocab, cfg):
        super().__init__()
        self.emb = nn.Embedding(vocab, cfg.d_model, padding_idx=PAD_ID)
        self.pos = nn.Embedding(1024, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.core = nn.Transformer(cfg.d_model, cfg.heads, cfg.layers, cfg.layers, cfg.ffn,
                                   cfg.dropout, batch_first=True, norm_first=True)
        self.proj = nn.Linear(cfg.d_model, vocab, bias=False)
        self.proj.weight = self.emb.weight
        self.scale = cfg.d_model ** 0.5

    def embed(self, x):
        pos = torch.arange(x.size(1), device=x.device)
        return self.drop(self.emb(x) * self.scale + self.pos(pos))

    def forward(self, src, tgt_in):
        causal = self.core.generate_square_subsequent_mask(tgt_in.size(1), device=src.device)
        h = self.core(self.embed(src), self.embed(tgt_in), tgt_mask=causal,
                      src_key_padding_mask=src.eq(PAD_ID),
                      tgt_key_padding_mask=tgt_in.eq(PAD_ID),
                      memory_key_padding_mask=src.eq(PAD_ID))
        return self.proj(h)

    @torch.no_grad()
    def translate(self, src, max_len=200):
        smask = src.eq(PAD_ID)
        mem = self.core.encoder(self.embed(src), src_key_padding_mask=smask)
        ys = torch.full((src.size(0), 1), BOS_ID, device=src.device, dtype=torch.long)
        finished = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            causal = self.core.generate_square_subsequent_mask(ys.size(1), device=src.device)
            h = self.core.decoder(self.embed(ys), mem, tgt_mask=causal, memory_key_padding_mask=smask)
            nxt = self.proj(h[:, -1]).argmax(-1).masked_fill(finished, PAD_ID)
            ys = torch.cat([ys, nxt[:, None]], dim=1)
            finished |= nxt.eq(EOS_ID)
            if finished.all():
                break
        return ys[:, 1:]


def lr_at(step, cfg):
    step = max(step, 1)
    return cfg.lr * min(step / cfg.warmup, math.sqrt(cfg.warmup / step))


@torch.no_grad()
def validate(model, data, sp, refs, rank, world, device):
    model.eval()
    n = len(data["src"])
    loss_sum = torch.zeros(2, device=device, dtype=torch.float64)
    local = []
    mine = list(range(rank, n, world))
    for b in range(0, len(mine), 100):
        batch = [(i, data["src"][i].long(), data["tgt"][i].long()) for i in mine[b : b + 100]]
        idx, src, tgt = collate(batch)
        src, tgt = src.to(device), tgt.to(device)
        logits = model(src, tgt[:, :-1])
        loss_sum[0] += F.cross_entropy(logits.flatten(0, 1).float(), tgt[:, 1:].flatten(),
                                       ignore_index=PAD_ID, reduction="sum")
        loss_sum[1] += tgt[:, 1:].ne(PAD_ID).sum()
        for i, h in zip(idx.tolist(), model.translate(src).tolist()):
            h = h[: h.index(EOS_ID)] if EOS_ID in h else h
            local.append((i, sp.decode([t for t in h if t != PAD_ID])))
    dist.all_reduce(loss_sum)
    parts = [None] * world
    dist.all_gather_object(parts, local)
    model.train()
    hyp = dict(p for part in parts for p in part)
    bleu = sacrebleu.corpus_bleu([hyp[i] for i in range(n)], [refs]).score
    return (loss_sum[0] / loss_sum[1]).item(), bleu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = load_config(ap.parse_args().config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    sp = spm.SentencePieceProcessor(model_file=cfg.spm_model)
    train = load_split(cfg, "train", sp)
    valid = load_split(cfg, "valid", sp)
    with open(os.path.join(cfg.data_dir, f"valid.{cfg.tgt}"), encoding="utf-8") as f:
        valid_refs = [l.strip() for l in f]

    train_ds = BinDataset(train)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=2, pin_memory=True, drop_last=True)

    vocab = sp.get_piece_size()
    model = DDP(NMTModel(vocab, cfg).to(device), device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
    update, best = 0, float("-inf")
    for epoch in range(1, cfg.epochs + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (_, src, tgt) in enumerate(loader):
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            last_micro = (i + 1) % cfg.accum_steps == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with (nullcontext() if last_micro else model.no_sync()):
                    logits = model(src, tgt[:, :-1])
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt[:, 1:].flatten(),
                                           ignore_index=PAD_ID, label_smoothing=cfg.label_smoothing)
                    (loss / cfg.accum_steps).backward()
            if last_micro:
                for g in optim.param_groups:
                    g["lr"] = lr_at(update + 1, cfg)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                optim.zero_grad(set_to_none=True)
                update += 1
                if update % 100 == 0:
                    avg = loss.detach().clone()
                    dist.all_reduce(avg)
                    if rank == 0:
                        print(f"ep {epoch} upd {update} loss {avg.item() / world:.3f} "
                              f"lr {lr_at(update, cfg):.2e} {time.time() - t0:.0f}s", flush=True)

        vloss, bleu = validate(model.module, valid, sp, valid_refs, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch}: valid loss {vloss:.3f} BLEU {bleu:.2f}", flush=True)
            state = {"model": model.module.state_dict(), "optim": optim.state_dict(),
                     "epoch": epoch, "update": update}
            torch.save(state, os.path.join(cfg.out_dir, "checkpoint_last.pt"))
            if bleu > best:
                best = bleu
                torch.save(state, os.path.join(cfg.out_dir, "checkpoint_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
