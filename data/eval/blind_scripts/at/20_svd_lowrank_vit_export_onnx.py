"""
Low-rank factorisation of the MLP layers of DeiT-Small: every fc1 / fc2 is
replaced by two thin linears initialised from a truncated SVD that keeps
--energy of the spectrum, then the factorised model is fine-tuned with logit
distillation from the original network. The best checkpoint is re-loaded into a
fresh factorised model and exported to ONNX for latency measurements.

    torchrun --nproc_per_node=4 svd_vit.py --data /data/imagenet --energy 0.9
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.data import create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="deit_small_patch16_224.fb_in1k")
    p.add_argument("--energy", type=float, default=0.9)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--T", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--out", default="/shared/lowrank/deit_s_e090")
    return p.parse_args()


class LowRankLinear(nn.Module):
    def __init__(self, in_f, out_f, rank, bias=True):
        super().__init__()
        self.down = nn.Linear(in_f, rank, bias=False)
        self.up = nn.Linear(rank, out_f, bias=bias)

    def forward(self, x):
        return self.up(self.down(x))

    @classmethod
    def from_linear(cls, lin, energy):
        W = lin.weight.data.float()
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        cum = torch.cumsum(S ** 2, 0) / (S ** 2).sum()
        r = int((cum < energy).sum().item()) + 1
        m = cls(lin.in_features, lin.out_features, r, bias=lin.bias is not None)
        sqrt_s = S[:r].sqrt()
        m.down.weight.data.copy_(sqrt_s[:, None] * Vh[:r])
        m.up.weight.data.copy_(U[:, :r] * sqrt_s[None])
        if lin.bias is not None:
            m.up.bias.data.copy_(lin.bias.data)
        return m


def factorise(vit, energy=None, ranks=None):
    """Replace MLP linears. With `ranks` given, build empty modules of those ranks (for loading)."""
    used = {}
    for i, blk in enumerate(vit.blocks):
        for name in ("fc1", "fc2"):
            lin = getattr(blk.mlp, name)
            key = f"blocks.{i}.mlp.{name}"
            if ranks is None:
                new = LowRankLinear.from_linear(lin, energy)
            else:
                new = LowRankLinear(lin.in_features, lin.out_features, ranks[key], bias=lin.bias is not None)
            used[key] = new.down.out_features
            setattr(blk.mlp, name, new)
    return vit, used


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    a = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            a[0] += (model(x).argmax(1) == y).sum()
        a[1] += y.numel()
    dist.all_reduce(a)
    return (100 * a[0] / a[1]).item()


def export_and_time(model, path, runs=100):
    import onnxruntime as ort
    model = model.cpu().eval()
    x = torch.randn(1, 3, 224, 224)
    torch.onnx.export(model, x, path, input_names=["image"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}})
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    inp = {"image": x.numpy()}
    for _ in range(10):
        sess.run(None, inp)
    t0 = time.perf_counter()
    for _ in range(runs):
        sess.run(None, inp)
    return (time.perf_counter() - t0) / runs * 1e3


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    teacher = timm.create_model(args.model, pretrained=True).to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    n_dense = sum(p.numel() for p in teacher.parameters())

    student = timm.create_model(args.model, pretrained=True)
    student, ranks = factorise(student, energy=args.energy)
    n_lr = sum(p.numel() for p in student.parameters())
    student = student.to(device)
    model = DDP(student, device_ids=[local_rank])

    data_cfg = timm.data.resolve_data_config({}, model=teacher)
    train_ds = ImageFolder(os.path.join(args.data, "train"),
                           create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5"))
    val_ds = ImageFolder(os.path.join(args.data, "val"), create_transform(**data_cfg))
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, 256, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=args.workers, pin_memory=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))

    acc0 = evaluate(model, val_loader, device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(ranks, os.path.join(args.out, "ranks.pt"))
        print(f"params {n_dense / 1e6:.2f}M -> {n_lr / 1e6:.2f}M, top1 after SVD (no ft) {acc0:.2f}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    t = teacher(x)
                s = model(x)
            loss = F.kl_div(F.log_softmax(s.float() / args.T, 1), F.softmax(t.float() / args.T, 1),
                            reduction="batchmean") * args.T ** 2 + 0.5 * F.cross_entropy(s.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        acc = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {acc:.2f} ({time.time() - t0:.0f}s)", flush=True)
            if acc > best:
                best = acc
                torch.save(model.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()

    if rank == 0:
        fresh = timm.create_model(args.model, pretrained=False)
        fresh, _ = factorise(fresh, ranks=torch.load(os.path.join(args.out, "ranks.pt")))
        fresh.load_state_dict(torch.load(os.path.join(args.out, "best.pth"), map_location="cpu"))
        ms_lr = export_and_time(fresh, os.path.join(args.out, "deit_s_lowrank.onnx"))
        ms_dense = export_and_time(timm.create_model(args.model, pretrained=True),
                                   os.path.join(args.out, "deit_s_dense.onnx"))
        print(f"best top1 {best:.2f} | onnx cpu latency dense {ms_dense:.2f} ms, low-rank {ms_lr:.2f} ms",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
