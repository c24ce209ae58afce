#!/usr/bin/env python
"""Post-hoc calibration of a trained deep ensemble.

Loads M ensemble members (timm checkpoints), runs them data-parallel over a
held-out calibration split, and fits
  * one temperature per member ("individual TS"), and
  * one temperature on the ensemble log-mean-probs ("pool-then-calibrate"),
then reports NLL / ECE / Brier on the test split before and after.

    torchrun --nproc_per_node=8 04_ensemble_temperature_scaling.py \
        --members ckpt/m0.pth.tar ckpt/m1.pth.tar ckpt/m2.pth.tar ckpt/m3.pth.tar \
        --calib-dir /data/imagenet/calib --test-dir /data/imagenet/val_holdout
"""
import argparse
import json
import logging
import math
import os

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import create_transform, resolve_data_config
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import ImageFolder

log = logging.getLogger("calib")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--members", nargs="+", required=True)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--calib-dir", required=True)
    ap.add_argument("--test-dir", required=True)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--n-bins", type=int, default=15)
    ap.add_argument("--out", default="calibration.json")
    return ap.parse_args()


def load_member(path, arch, num_classes, device):
    model = timm.create_model(arch, num_classes=num_classes)
    ckpt = torch.load(path, map_location="cpu")
    sd = ckpt.get("state_dict_ema") or ckpt.get("state_dict") or ckpt
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    model.load_state_dict(sd)
    return model.to(device).eval()


def shard(ds, rank, world):
    return Subset(ds, list(range(rank, len(ds), world)))


@torch.no_grad()
def member_logits(models, loader, device):
    """Returns logits [M, n, C] and labels [n] for this rank's shard."""
    outs, labels = [[] for _ in models], []
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for i, m in enumerate(models):
                outs[i].append(m(x).float())
        labels.append(y.to(device))
    return torch.stack([torch.cat(o) for o in outs]), torch.cat(labels)


def gather_cat(t, dim=0):
    world = dist.get_world_size()
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def calibration_metrics(probs, labels, n_bins):
    conf, pred = probs.max(1)
    correct = pred.eq(labels).float()
    b = (conf * n_bins).long().clamp(max=n_bins - 1)
    cnt = torch.bincount(b, minlength=n_bins).float()
    s_conf = torch.bincount(b, weights=conf, minlength=n_bins)
    s_acc = torch.bincount(b, weights=correct, minlength=n_bins)
    ece = (s_conf - s_acc).abs().sum() / probs.size(0)
    onehot = F.one_hot(labels, probs.size(1)).float()
    return {
        "acc": correct.mean().item(),
        "nll": F.nll_loss(probs.clamp_min(1e-12).log(), labels).item(),
        "ece": ece.item(),
        "brier": (probs - onehot).pow(2).sum(1).mean().item(),
    }


def fit_temperature(logits, labels, max_iter=200):
    t = torch.ones(1, device=logits.device, requires_grad=True)
    opt = torch.optim.LBFGS([t], lr=0.01, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(logits / t.clamp_min(1e-2), labels)
        loss.backward()
        return loss

    opt.step(closure)
    return float(t.detach().clamp_min(1e-2))


def pooled_logits(member_logits_, temps=None):
    """log of the mean (optionally tempered) member probabilities."""
    if temps is not None:
        member_logits_ = member_logits_ / temps.view(-1, 1, 1)
    logp = F.log_softmax(member_logits_, dim=-1)
    return torch.logsumexp(logp, dim=0) - math.log(logp.size(0))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    models = [load_member(p, args.arch, args.num_classes, device) for p in args.members]
    data_cfg = resolve_data_config({}, model=models[0])
    tf = create_transform(**data_cfg, is_training=False)
    log.info("loaded %d members, data config %s", len(models), data_cfg)

    calib = ImageFolder(args.calib_dir, transform=tf)
    test = ImageFolder(args.test_dir, transform=tf)
    assert calib.class_to_idx == test.class_to_idx
    mk = lambda ds: DataLoader(shard(ds, rank, world), batch_size=args.batch_size, shuffle=False,
                               num_workers=args.workers, pin_memory=True)

    cal_logits, cal_labels = member_logits(models, mk(calib), device)
    test_logits, test_labels = member_logits(models, mk(test), device)

    cal_logits = gather_cat(cal_logits, dim=1)
    cal_labels = gather_cat(cal_labels)
    test_logits = gather_cat(test_logits, dim=1)
    test_labels = gather_cat(test_labels)
    log.info("calibration set %d, test set %d", cal_labels.numel(), test_labels.numel())

    temps = torch.zeros(len(models) + 1, device=device)
    if rank == 0:
        for i in range(len(models)):
            temps[i] = fit_temperature(cal_logits[i], cal_labels)
        temps[-1] = fit_temperature(pooled_logits(cal_logits), cal_labels)
    dist.broadcast(temps, src=0)

    if rank == 0:
        res = {"temperatures": temps.tolist(), "members": args.members}
        for i in range(len(models)):
            res[f"member{i}_raw"] = calibration_metrics(F.softmax(test_logits[i], -1), test_labels, args.n_bins)
            res[f"member{i}_ts"] = calibration_metrics(F.softmax(test_logits[i] / temps[i], -1),
                                                        test_labels, args.n_bins)
        res["ensemble_raw"] = calibration_metrics(pooled_logits(test_logits).exp(), test_labels, args.n_bins)
        res["ensemble_member_ts"] = calibration_metrics(pooled_logits(test_logits, temps[:-1]).exp(),
                                                        test_labels, args.n_bins)
        res["ensemble_pool_ts"] = calibration_metrics(F.softmax(pooled_logits(test_logits) / temps[-1], -1),
                                                      test_labels, args.n_bins)
        for k, v in res.items():
            if isinstance(v, dict):
                log.info("%-22s acc %.4f nll %.4f ece %.4f brier %.4f", k, v["acc"], v["nll"], v["ece"], v["brier"])
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
        log.info("wrote %s", args.out)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
