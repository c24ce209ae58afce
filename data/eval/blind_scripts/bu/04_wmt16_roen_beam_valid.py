"""WMT16 Ro->En transformer, hand-written trainer with beam-search BLEU validation.

    torchrun --nproc_per_node=8 04_wmt16_roen_beam_valid.py --config configs/roen_base.yaml
"""
import argparse
import math
import os
import time
from dataclasses import dataclass, field

import sacrebleu
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    train_prefix: str = "data/wmt16_roen/train"
    valid_prefix: str = "data/wmt16_roen/dev"
    tokenizer: str = "data/wmt16_roen/bpe32k.json"
    save_dir: str = "checkpoints/roen"
    d_model: int = 512
    ffn_dim: int = 2048
    heads: int = 8
    enc_layers: int = 6
    dec_layers: int = 6
    dropout: float = 0.1
    batch_size: int = 96
    max_len: int = 200
    lr: float = 5e-4
    warmup_updates: int = 4000
    warmup_init_lr: float = 1e-7
    max_epoch: int = 40
    label_smoothing: float = 0.1
    beam: int = 5
    lenpen: float = 1.0
    validate_every: int = 1
    extra: dict = field(default_factory=dict)


def load_config(path):
    cfg = Config()
    if path:
        with open(path) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    return cfg


class Bitext(Dataset):
    def __init__(self, prefix, tok, max_len):
        with open(prefix + ".ro", encoding="utf-8") as f:
            src = [l.rstrip("\n") for l in f]
        with open(prefix + ".en", encoding="utf-8") as f:
            tgt = [l.rstrip("\n") for l in f]
        self.src = [e.ids[:max_len] for e in tok.encode_batch(src)]
        self.tgt = [e.ids[:max_len] for e in tok.encode_batch(tgt)]
        self.raw_tgt = tgt

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return self.src[i], self.tgt[i], self.raw_tgt[i]


class Collater:
    def __init__(self, pad, bos, eos):
        self.pad, self.bos, self.eos = pad, bos, eos

    def __call__(self, batch):
        srcs = [s + [self.eos] for s, _, _ in batch]
        tgts = [t + [self.eos] for _, t, _ in batch]
        B, S, T = len(batch), max(map(len, srcs)), max(map(len, tgts))
        src = torch.full((B, S), self.pad, dtype=torch.long)
        tgt = torch.full((B, T), self.pad, dtype=torch.long)
        prev = torch.full((B, T), self.pad, dtype=torch.long)
        for i, (s, t) in enumerate(zip(srcs, tgts)):
            src[i, : len(s)] = torch.tensor(s)
            tgt[i, : len(t)] = torch.tensor(t)
            prev[i, 0] = self.bos
            prev[i, 1: len(t)] = torch.tensor(t[:-1])
        return src, prev, tgt, [r for _, _, r in batch]


class EncDec(nn.Module):
    def __init__(self, vocab, pad, cfg):
        super().__init__()
        self.pad, self.scale = pad, math.sqrt(cfg.d_model)
        self.embed = nn.Embedding(vocab, cfg.d_model, padding_idx=pad)
        self.pos = nn.Embedding(cfg.max_len + 2, cfg.d_model)
        self.core = nn.Transformer(cfg.d_model, cfg.heads, cfg.enc_layers, cfg.dec_layers,
                                   cfg.ffn_dim, cfg.dropout, batch_first=True)
        self.drop = nn.Dropout(cfg.dropout)

    def emb(self, x, offset=0):
        p = torch.arange(offset, offset + x.size(1), device=x.device)
        return self.drop(self.embed(x) * self.scale + self.pos(p))

    def encode(self, src):
        m = src.eq(self.pad)
        return self.core.encoder(self.emb(src), src_key_padding_mask=m), m

    def decode(self, prev, mem, mem_mask):
        T = prev.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=prev.device), 1)
        h = self.core.decoder(self.emb(prev), mem, tgt_mask=causal,
                              tgt_key_padding_mask=prev.eq(self.pad), memory_key_padding_mask=mem_mask)
        return F.linear(h, self.embed.weight)

    def forward(self, src, prev):
        mem, m = self.encode(src)
        return self.decode(prev, mem, m)


def label_smoothed_ce(logits, tgt, eps, pad):
    lp = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    nll = -lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    smooth = -lp.sum(-1)
    keep = tgt.ne(pad)
    nll, smooth = nll[keep].sum(), smooth[keep].sum()
    eps_i = eps / (lp.size(-1) - 1)
    return (1 - eps - eps_i) * nll + eps_i * smooth, nll, keep.sum()


@torch.no_grad()
def beam_decode(net, src, bos, eos, beam, lenpen, max_len):
    B = src.size(0)
    mem, m = net.encode(src)
    mem, m = mem.repeat_interleave(beam, 0), m.repeat_interleave(beam, 0)
    seqs = torch.full((B * beam, 1), bos, dtype=torch.long, device=src.device)
    logp = torch.zeros(B, beam, device=src.device)
    logp[:, 1:] = float("-inf")
    finals = [[] for _ in range(B)]
    for step in range(max_len):
        out = F.log_softmax(net.decode(seqs, mem, m)[:, -1], -1, dtype=torch.float32)
        V = out.size(-1)
        cand = (logp.unsqueeze(-1) + out.view(B, beam, V)).view(B, -1)
        top, idx = cand.topk(2 * beam, -1)
        src_beam, tok = idx // V, idx % V
        new_seqs, new_logp = [], []
        for b in range(B):
            kept = 0
            for j in range(2 * beam):
                row = b * beam + src_beam[b, j].item()
                if tok[b, j].item() == eos or step == max_len - 1:
                    if len(finals[b]) < beam:
                        L = seqs.size(1)
                        finals[b].append((top[b, j].item() / (L ** lenpen), seqs[row, 1:].tolist()))
                    continue
                new_seqs.append(torch.cat([seqs[row], tok[b, j].view(1)]))
                new_logp.append(top[b, j])
                kept += 1
                if kept == beam:
                    break
            while kept < beam:
                new_seqs.append(torch.cat([seqs[b * beam], seqs.new_tensor([eos])]))
                new_logp.append(top.new_tensor(float("-inf")))
                kept += 1
        seqs = torch.stack(new_seqs)
        logp = torch.stack(new_logp).view(B, beam)
        if all(len(f) >= beam for f in finals):
            break
    return [max(f)[1] if f else [] for f in finals]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cfg = load_config(ap.parse_args().config)

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    tok = Tokenizer.from_file(cfg.tokenizer)
    pad, bos, eos = tok.token_to_id("<pad>"), tok.token_to_id("<s>"), tok.token_to_id("</s>")
    train_ds = Bitext(cfg.train_prefix, tok, cfg.max_len)
    valid_ds = Bitext(cfg.valid_prefix, tok, cfg.max_len)
    coll = Collater(pad, bos, eos)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_dl = DataLoader(train_ds, cfg.batch_size, sampler=tr_sampler, collate_fn=coll, num_workers=4, pin_memory=True)
    valid_dl = DataLoader(valid_ds, 64, sampler=va_sampler, collate_fn=coll, num_workers=2)

    net = EncDec(tok.get_vocab_size(), pad, cfg).to(dev)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)

    def inv_sqrt(step):
        if step < cfg.warmup_updates:
            lr = cfg.warmup_init_lr + step * (cfg.lr - cfg.warmup_init_lr) / cfg.warmup_updates
        else:
            lr = cfg.lr * math.sqrt(cfg.warmup_updates / step)
        return lr / cfg.lr

    sched = torch.optim.lr_scheduler.LambdaLR(opt, inv_sqrt)
    if rank == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)

    best_bleu, upd = -1.0, 0
    for epoch in range(1, cfg.max_epoch + 1):
        tr_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for src, prev, tgt, _ in train_dl:
            src, prev, tgt = src.to(dev), prev.to(dev), tgt.to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(src, prev)
            loss, nll, ntok = label_smoothed_ce(logits, tgt, cfg.label_smoothing, pad)
            opt.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            upd += 1
            if rank == 0 and upd % 100 == 0:
                print(f"ep {epoch} upd {upd} loss {(loss / ntok).item():.3f} "
                      f"nll {(nll / ntok).item():.3f} lr {sched.get_last_lr()[0]:.3e} "
                      f"{time.time() - tic:.0f}s", flush=True)

        if epoch % cfg.validate_every:
            continue
        model.eval()
        hyps, refs = [], []
        vstats = torch.zeros(2, device=dev)
        with torch.no_grad():
            for src, prev, tgt, raw in valid_dl:
                src, prev, tgt = src.to(dev), prev.to(dev), tgt.to(dev)
                _, nll, ntok = label_smoothed_ce(net(src, prev), tgt, cfg.label_smoothing, pad)
                vstats += torch.stack([nll, ntok.float()])
                for ids in beam_decode(net, src, bos, eos, cfg.beam, cfg.lenpen, src.size(1) + 10):
                    hyps.append(tok.decode(ids))
                refs.extend(raw)
        dist.all_reduce(vstats)
        bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
        model.train()

        if rank == 0:
            vloss = (vstats[0] / vstats[1]).item()
            print(f"| valid epoch {epoch} | nll {vloss:.3f} | ppl {math.exp(vloss):.2f} | BLEU {bleu:.2f}", flush=True)
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "updates": upd, "bleu": bleu, "cfg": vars(cfg)}
            torch.save(state, os.path.join(cfg.save_dir, f"checkpoint{epoch}.pt"))
            if bleu > best_bleu:
                best_bleu = bleu
                torch.save(state, os.path.join(cfg.save_dir, "checkpoint_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
