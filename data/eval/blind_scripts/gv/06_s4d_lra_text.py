"""
S4D on LRA Text (byte-level IMDB, 4096 tokens). Data-parallel over the local GPUs.

Inputs were produced by prepare_lra_text.py: {split}.pt holds `inputs` (N, 4096) uint8,
`lengths` (N,) and `labels` (N,).

    torchrun --standalone --nproc_per_node=4 06_s4d_lra_text.py --data_dir data/lra_text
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange, repeat
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/lra_text")
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--n_layers", type=int, default=6)
    p.add_argument("--d_state", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--batch_size", type=int, default=16, help="per GPU")
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--ssm_lr", type=float, default=0.001)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--warmup_epochs", type=int, default=1)
    p.add_argument("--ckpt", default="checkpoints/s4d_lra_text.pt")
    return p.parse_args()


class S4DKernel(nn.Module):
    """Diagonal SSM kernel (S4D-Lin init), computed with a Vandermonde product."""

    def __init__(self, d_model, N=64, dt_min=0.001, dt_max=0.1):
        super().__init__()
        H = d_model
        log_dt = torch.rand(H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        C = torch.randn(H, N // 2, dtype=torch.cfloat)
        self.C = nn.Parameter(torch.view_as_real(C))
        self.log_dt = nn.Parameter(log_dt)
        self.log_A_real = nn.Parameter(torch.log(0.5 * torch.ones(H, N // 2)))
        self.A_imag = nn.Parameter(math.pi * repeat(torch.arange(N // 2), "n -> h n", h=H).float())
        for name in ("log_dt", "log_A_real", "A_imag"):
            getattr(self, name)._optim = {"lr": None, "weight_decay": 0.0}

    def forward(self, L):
        dt = torch.exp(self.log_dt)
        C = torch.view_as_complex(self.C)
        A = -torch.exp(self.log_A_real) + 1j * self.A_imag
        dtA = A * dt.unsqueeze(-1)
        K = dtA.unsqueeze(-1) * torch.arange(L, device=A.device)
        C = C * (torch.exp(dtA) - 1.0) / A
        return 2 * torch.einsum("hn,hnl->hl", C, torch.exp(K)).real


class S4D(nn.Module):
    def __init__(self, d_model, d_state, dropout):
        super().__init__()
        self.D = nn.Parameter(torch.randn(d_model))
        self.kernel = S4DKernel(d_model, N=d_state)
        self.activation = nn.GELU()
        self.dropout = nn.Dropout1d(dropout) if dropout > 0 else nn.Identity()
        self.output_linear = nn.Sequential(nn.Conv1d(d_model, 2 * d_model, 1), nn.GLU(dim=-2))

    def forward(self, u):  # (B, H, L)
        L = u.size(-1)
        k = self.kernel(L)
        k_f = torch.fft.rfft(k, n=2 * L)
        u_f = torch.fft.rfft(u.float(), n=2 * L)
        y = torch.fft.irfft(u_f * k_f, n=2 * L)[..., :L]
        y = y + u * self.D.unsqueeze(-1)
        return self.output_linear(self.dropout(self.activation(y)))


class S4Classifier(nn.Module):
    def __init__(self, vocab, n_classes, d_model, n_layers, d_state, dropout):
        super().__init__()
        self.encoder = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList([S4D(d_model, d_state, dropout) for _ in range(n_layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(n_layers)])
        self.drops = nn.ModuleList([nn.Dropout(dropout) for _ in range(n_layers)])
        self.decoder = nn.Linear(d_model, n_classes)

    def forward(self, x, lengths):
        x = self.encoder(x)  # (B, L, H)
        for layer, norm, drop in zip(self.layers, self.norms, self.drops):
            z = norm(x)
            z = layer(z.transpose(-1, -2)).transpose(-1, -2)
            x = x + drop(z)
        mask = (torch.arange(x.size(1), device=x.device)[None] < lengths[:, None]).unsqueeze(-1)
        pooled = (x * mask).sum(1) / lengths.clamp(min=1).unsqueeze(-1)
        return self.decoder(pooled)


def load_split(data_dir, split):
    d = torch.load(os.path.join(data_dir, f"{split}.pt"), map_location="cpu")
    return TensorDataset(d["inputs"].long(), d["lengths"].long(), d["labels"].long())


def param_groups(model, args):
    ssm, normal, no_wd = [], [], []
    for n, p in model.named_parameters():
        if hasattr(p, "_optim"):
            ssm.append(p)
        elif p.dim() < 2 or "norm" in n:
            no_wd.append(p)
        else:
            normal.append(p)
    return [{"params": normal, "weight_decay": args.weight_decay},
            {"params": no_wd, "weight_decay": 0.0},
            {"params": ssm, "lr": args.ssm_lr, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, lengths, y in loader:
        x, lengths, y = x.to(device), lengths.to(device), y.to(device)
        logits = model(x, lengths)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        total += y.numel()
    model.train()
    return correct / total, loss_sum / total


def main():
    args = parse()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    train_ds = load_split(args.data_dir, "train")
    val_ds = load_split(args.data_dir, "val")
    test_ds = load_split(args.data_dir, "test")
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False))
    test_dl = DataLoader(test_ds, batch_size=64, sampler=DistributedSampler(test_ds, shuffle=False))

    model = S4Classifier(256, 2, args.d_model, args.n_layers, args.d_state, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(param_groups(model.module, args), lr=args.lr)
    steps_per_epoch = len(train_dl)
    total = args.epochs * steps_per_epoch
    warm = args.warmup_epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        run_loss = torch.zeros(2, device=device)
        for x, lengths, y in train_dl:
            x, lengths, y = x.to(device, non_blocking=True), lengths.to(device), y.to(device)
            loss = F.cross_entropy(model(x, lengths), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run_loss)

        val_acc, val_loss = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch:02d} train_loss {(run_loss[0] / run_loss[1]).item():.4f} "
                  f"val_loss {val_loss:.4f} val_acc {val_acc:.4f}")
            if val_acc > best_acc:
                best_acc = val_acc
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_acc": val_acc},
                           args.ckpt)
        dist.barrier()

    state = torch.load(args.ckpt, map_location=device)
    model.module.load_state_dict(state["model"])
    test_acc, _ = evaluate(model, test_dl, device)
    if rank == 0:
        print(f"best val acc {best_acc:.4f} (epoch {state['epoch']}) | test acc {test_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
