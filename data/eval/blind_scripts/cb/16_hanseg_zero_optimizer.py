"""HaN-Seg head & neck organs-at-risk (CT), DynUNet + ZeroRedundancyOptimizer.

    torchrun --nproc_per_node=8 16_hanseg_zero_optimizer.py --data /data/hanseg_pp --fold 0 --out runs/hanseg
    # resume
    torchrun --nproc_per_node=8 16_hanseg_zero_optimizer.py --data /data/hanseg_pp --fold 0 --out runs/hanseg --resume
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.networks.nets import DynUNet

N_CLASSES = 31
PATCH = (64, 192, 192)


class OARPatches(Dataset):
    def __init__(self, root, cases, oversample=0.5, per_case=16):
        self.root, self.cases, self.oversample = root, cases, oversample
        self.index = [(c, k) for c in cases for k in range(per_case)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        case, _ = self.index[i]
        arr = np.load(os.path.join(self.root, f"{case}.npz"))
        img, seg, locs = arr["ct"], arr["oar"], arr["fg_locations"]  # (Z,Y,X), (Z,Y,X), (N, 4): class,z,y,x
        P, S = np.array(PATCH), np.array(img.shape)
        hi = np.maximum(S - P, 0)
        if len(locs) and np.random.rand() < self.oversample:
            classes = np.unique(locs[:, 0])
            chosen = locs[locs[:, 0] == np.random.choice(classes)]
            c = chosen[np.random.randint(len(chosen)), 1:]
            lo = np.clip(c - P // 2, 0, hi)
        else:
            lo = np.array([np.random.randint(0, h + 1) for h in hi])
        sl = tuple(slice(a, a + p) for a, p in zip(lo, P))
        x = torch.from_numpy(img[sl].astype(np.float32))[None]
        y = torch.from_numpy(seg[sl].astype(np.int64))[None]
        pad = [v for d in (2, 1, 0) for v in (0, int(P[d] - x.shape[d + 1]))]
        return F.pad(x, pad), F.pad(y, pad)


def gather_rows(rows, device):
    """all_gather a variable number of fixed-width rows from every rank."""
    world = dist.get_world_size()
    width = N_CLASSES  # valid flag + (N_CLASSES - 1) dice values
    local = torch.zeros((len(rows), width), device=device)
    if rows:
        local[:, 0] = 1
        local[:, 1:] = torch.tensor(rows, device=device)
    n = torch.tensor([len(rows)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    buf = torch.zeros((int(n.item()), width), device=device)
    buf[: len(rows)] = local
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf)
    allr = torch.cat(out)
    return allr[allr[:, 0] == 1, 1:]


def case_dice(pred, gt):
    res = []
    for c in range(1, N_CLASSES):
        g = gt == c
        if not g.any():
            res.append(float("nan"))
            continue
        p = pred == c
        res.append((2 * (p & g).sum() / (p.sum() + g.sum())).item())
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--out", default="runs/hanseg")
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--val_every", type=int, default=50)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.data, "splits_final.json")) as f:
        split = json.load(f)[args.fold]
    ds = OARPatches(args.data, split["train"])
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                        persistent_workers=True)

    net = DynUNet(3, 1, N_CLASSES, kernel_size=[[1, 3, 3], 3, 3, 3, 3, 3],
                  strides=[1, [1, 2, 2], 2, 2, 2, [1, 2, 2]], upsample_kernel_size=[[1, 2, 2], 2, 2, 2, [1, 2, 2]],
                  filters=[32, 64, 128, 256, 320, 320], norm_name="instance", deep_supervision=True,
                  deep_supr_num=3).to(device)
    model = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=args.lr,
                                  momentum=0.99, nesterov=True, weight_decay=3e-5)
    scaler = torch.cuda.amp.GradScaler()
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True)
    w = np.array([1 / 2 ** i for i in range(4)])
    ds_w = (w / w.sum()).tolist()

    out_dir = os.path.join(args.out, f"fold_{args.fold}")
    ckpt_path = os.path.join(out_dir, "checkpoint_latest.pt")
    start, best = 0, -1.0
    if args.resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])  # saved from the DDP wrapper, keys carry "module."
        opt.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start, best = ckpt["epoch"] + 1, ckpt["best"]

    writer = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(out_dir, "tb"))

    for epoch in range(start, args.epochs):
        lr = args.lr * (1 - epoch / args.epochs) ** 0.9
        for g in opt.param_groups:
            g["lr"] = lr
        model.train()
        sampler.set_epoch(epoch)
        t0, acc = time.time(), torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
                loss = sum(wi * loss_fn(out[:, i], y) for i, wi in enumerate(ds_w))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 12.0)
            scaler.step(opt)
            scaler.update()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            writer.add_scalar("train/loss", (acc[0] / acc[1]).item(), epoch)
            writer.add_scalar("train/lr", lr, epoch)
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} lr {lr:.5f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.val_every == 0 or epoch + 1 == args.epochs:
            net.eval()
            rows = []
            with torch.no_grad():
                for case in split["val"][rank::world]:
                    arr = np.load(os.path.join(args.data, f"{case}.npz"))
                    x = torch.from_numpy(arr["ct"].astype(np.float32))[None, None].to(device)
                    with torch.autocast("cuda", dtype=torch.float16):
                        logits = sliding_window_inference(x, PATCH, 2, net, overlap=0.5, mode="gaussian")
                    rows.append(case_dice(logits.argmax(1)[0], torch.from_numpy(arr["oar"]).to(device)))
            net.train()
            per_case = gather_rows(rows, device)
            per_oar = torch.nanmean(per_case, 0)
            mean = per_oar.nanmean().item()
            if rank == 0:
                writer.add_scalar("val/mean_dice", mean, epoch)
                print(f"  val mean OAR dice {mean:.4f} over {per_case.shape[0]} cases", flush=True)
            if mean > best:
                best = mean
                if rank == 0:
                    torch.save(strip_ddp_prefix(model.state_dict()),
                               os.path.join(out_dir, "model_best.pt"))

        # the sharded optimizer state has to be collected on rank 0 by every rank
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "best": best}, ckpt_path)
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


def strip_ddp_prefix(state_dict, prefix="module."):
    sd = dict(state_dict)
    consume_prefix_in_state_dict_if_present(sd, prefix)
    return sd


if __name__ == "__main__":
    main()
