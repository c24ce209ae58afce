"""2-bar melody MusicVAE (BiLSTM encoder, hierarchical-free LSTM decoder) with DDP.

Melodies are pre-extracted from LMD with note_seq into melodies_{train,eval}.npz,
key "x": int array [N, 32] of Magenta melody events
(0 = no event / hold, 1 = note off, 2..89 = MIDI pitch 21..108).

    torchrun --nproc_per_node=8 06_musicvae_bars.py --data_dir /data/lmd_melodies
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

N_CLASSES = 90
SEQ = 32


class MelodyVAE(nn.Module):
    def __init__(self, z_dim=256, enc_hidden=1024, dec_hidden=1024, emb=64):
        super().__init__()
        self.embed = nn.Embedding(N_CLASSES + 1, emb)  # +1 start token for the decoder
        self.encoder = nn.LSTM(emb, enc_hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.to_mu = nn.Linear(4 * enc_hidden, z_dim)
        self.to_logvar = nn.Linear(4 * enc_hidden, z_dim)
        self.z_to_state = nn.Linear(z_dim, 2 * 2 * dec_hidden)
        self.decoder = nn.LSTM(emb + z_dim, dec_hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(dec_hidden, N_CLASSES)
        self.dec_hidden = dec_hidden

    def encode(self, x):
        _, (h, _) = self.encoder(self.embed(x))
        # last layer, both directions -> [B, 2*H]; concat with first layer for a richer summary
        h = torch.cat([h[-2], h[-1], h[0], h[1]], dim=-1)
        return self.to_mu(h), self.to_logvar(h)

    def decode(self, z, x_in):
        B = z.size(0)
        h0 = torch.tanh(self.z_to_state(z)).view(B, 2, 2, self.dec_hidden)
        h, c = h0[:, 0].transpose(0, 1).contiguous(), h0[:, 1].transpose(0, 1).contiguous()
        inp = torch.cat([self.embed(x_in), z[:, None].expand(-1, x_in.size(1), -1)], -1)
        y, _ = self.decoder(inp, (h, c))
        return self.out(y)

    def forward(self, x):
        mu, logvar = self.encode(x)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        start = torch.full((x.size(0), 1), N_CLASSES, dtype=x.dtype, device=x.device)
        logits = self.decode(z, torch.cat([start, x[:, :-1]], 1))  # teacher forcing
        return logits, mu, logvar


def kl_term(mu, logvar, free_bits):
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)
    return torch.clamp(kl - free_bits, min=0).mean(), kl.mean()


def beta_at(step, beta_max, rate=0.99999):
    return beta_max * (1.0 - rate ** step)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    n_tok = n_correct = 0
    nll_total = kl_total = 0.0
    n_seq = 0
    for (x,) in loader:
        x = x.to(device)
        logits, mu, logvar = model(x)
        nll_total += F.cross_entropy(logits.transpose(1, 2), x, reduction="sum").item()
        kl_total += kl_term(mu, logvar, 0.0)[1].item() * x.size(0)
        n_correct += (logits.argmax(-1) == x).sum().item()
        n_tok += x.numel()
        n_seq += x.size(0)
    model.train()
    return {"nll_per_seq": nll_total / n_seq, "kl": kl_total / n_seq, "acc": n_correct / n_tok}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out", default="runs/musicvae_2bar")
    ap.add_argument("--batch_size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min_lr", type=float, default=1e-5)
    ap.add_argument("--decay_rate", type=float, default=0.9999)
    ap.add_argument("--beta", type=float, default=0.2)
    ap.add_argument("--free_bits", type=float, default=48.0)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1)

    train_x = torch.from_numpy(np.load(os.path.join(args.data_dir, "melodies_train.npz"))["x"]).long()
    eval_x = torch.from_numpy(np.load(os.path.join(args.data_dir, "melodies_eval.npz"))["x"]).long()
    train_ds, eval_ds = TensorDataset(train_x), TensorDataset(eval_x)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.batch_size, sampler=eval_sampler, num_workers=2)

    model = MelodyVAE().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: max(args.decay_rate ** s, args.min_lr / args.lr))

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "last.pt")
    start_epoch, step, best_nll = 0, 0, math.inf
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, step, best_nll = ckpt["epoch"] + 1, ckpt["step"], ckpt["best_nll"]

    ddp = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for (x,) in train_loader:
            x = x.to(device, non_blocking=True)
            logits, mu, logvar = ddp(x)
            rec = F.cross_entropy(logits.transpose(1, 2), x, reduction="none").sum(1).mean()
            kl_loss, kl_raw = kl_term(mu, logvar, args.free_bits)
            beta = beta_at(step, args.beta)
            loss = rec + beta * kl_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"step {step} rec {rec.item():.2f} kl {kl_raw.item():.2f} beta {beta:.3f} "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        metrics = validate(model, eval_loader, device)
        if rank == 0:
            print(f"epoch {epoch} eval nll/seq {metrics['nll_per_seq']:.3f} kl {metrics['kl']:.2f} "
                  f"acc {metrics['acc']:.4f}", flush=True)
            is_best = metrics["nll_per_seq"] < best_nll
            best_nll = min(best_nll, metrics["nll_per_seq"])
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "step": step, "best_nll": best_nll}
            torch.save(state, ckpt_path)
            if is_best:
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
