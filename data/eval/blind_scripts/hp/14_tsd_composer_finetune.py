"""Fine-tune a pretrained TSD-token MIDI transformer on a single-composer corpus, then
render a few samples from the best checkpoint.

    torchrun --nproc_per_node=4 14_tsd_composer_finetune.py \
        --base ckpt/tsd_base/model.pt --tokenizer ckpt/tsd_base/tokenizer.json \
        --midi_dir /data/chopin_midi --out runs/chopin_ft
"""
import argparse
import math
import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from miditok import TSD
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class TSDTransformer(nn.Module):
    def __init__(self, vocab_size, d_model=768, n_layers=12, n_heads=12, max_len=1024, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.layers = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.max_len = max_len

    def forward(self, ids):
        T = ids.size(1)
        h = self.embed(ids) + self.pos(torch.arange(T, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=ids.device)
        return self.lm_head(self.norm(self.layers(h, mask=mask, is_causal=True)))

    @torch.no_grad()
    def sample(self, prompt, steps, temperature=1.0, top_p=0.95, eos_id=None):
        ids = prompt
        for _ in range(steps):
            logits = self(ids[:, -self.max_len:])[:, -1] / temperature
            probs = F.softmax(logits.float(), -1)
            sp, si = probs.sort(-1, descending=True)
            cum = sp.cumsum(-1)
            sp[(cum - sp) > top_p] = 0
            nxt = si.gather(-1, torch.multinomial(sp / sp.sum(-1, keepdim=True), 1))
            ids = torch.cat([ids, nxt], 1)
            if eos_id is not None and (nxt == eos_id).all():
                break
        return ids


class PieceWindows(Dataset):
    def __init__(self, seqs, ctx, pad_id, train):
        self.seqs, self.ctx, self.pad_id, self.train = seqs, ctx, pad_id, train

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        ids = self.seqs[i]
        n = self.ctx + 1
        if len(ids) > n:
            s = random.randint(0, len(ids) - n) if self.train else 0
            ids = ids[s:s + n]
        out = torch.full((n,), self.pad_id, dtype=torch.long)
        out[:len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out


def encode_dir(tokenizer, midi_dir):
    bos, eos = tokenizer["BOS_None"], tokenizer["EOS_None"]
    seqs = []
    for p in sorted(Path(midi_dir).glob("**/*.mid")):
        try:
            seqs.append([bos] + tokenizer.encode(p).ids + [eos])
        except Exception as e:
            print(f"skip {p}: {e}")
    return seqs


@torch.no_grad()
def evaluate(net, loader, pad_id, device):
    net.eval()
    t = torch.zeros(2, device=device, dtype=torch.float64)
    for b in loader:
        b = b.to(device)
        logits = net(b[:, :-1])
        t[0] += F.cross_entropy(logits.transpose(1, 2), b[:, 1:], ignore_index=pad_id, reduction="sum")
        t[1] += (b[:, 1:] != pad_id).sum()
    dist.all_reduce(t)
    net.train()
    return (t[0] / t[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--midi_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--n_samples", type=int, default=8)
    ap.add_argument("--sample_len", type=int, default=1024)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(0)
    torch.manual_seed(0)

    tokenizer = TSD(params=Path(args.tokenizer))
    pad_id = tokenizer.pad_token_id
    seqs = encode_dir(tokenizer, args.midi_dir)
    # deterministic 90/10 split by position in the sorted file list
    val_seqs = seqs[::10]
    train_seqs = [s for i, s in enumerate(seqs) if i % 10 != 0]

    train_ds = PieceWindows(train_seqs, args.ctx, pad_id, train=True)
    val_ds = PieceWindows(val_seqs, args.ctx, pad_id, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.bs)

    net = TSDTransformer(len(tokenizer), max_len=args.ctx)
    net.load_state_dict(torch.load(args.base, map_location="cpu"))
    net.to(device)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))

    os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, "best.pt")
    best = math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for b in train_dl:
            b = b.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(b[:, :-1])
            loss = F.cross_entropy(logits.float().transpose(1, 2), b[:, 1:], ignore_index=pad_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

        val = evaluate(net, val_dl, pad_id, device)
        if rank == 0:
            print(f"epoch {epoch} train loss {loss.item():.4f} val loss {val:.4f}", flush=True)
            if val < best:
                best = val
                torch.save({"model": model.state_dict(), "epoch": epoch, "val_loss": val}, best_path)
        dist.barrier()

    # render samples from the best checkpoint
    if rank == 0:
        sampler_net = TSDTransformer(len(tokenizer), max_len=args.ctx).to(device).eval()
        ckpt = torch.load(best_path, map_location=device)
        sampler_net.load_state_dict(ckpt["model"])
        prompt = torch.full((args.n_samples, 1), tokenizer["BOS_None"], dtype=torch.long, device=device)
        out = sampler_net.sample(prompt, args.sample_len, temperature=1.0, top_p=0.95,
                                 eos_id=tokenizer["EOS_None"])
        sample_dir = Path(args.out) / "samples"
        sample_dir.mkdir(exist_ok=True)
        for i, ids in enumerate(out.tolist()):
            ids = [t for t in ids if t != pad_id]
            tokenizer.decode([ids]).dump_midi(sample_dir / f"sample_{i:02d}.mid")
        print(f"wrote {len(out)} samples from epoch {ckpt['epoch']} (val {ckpt['val_loss']:.4f})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
