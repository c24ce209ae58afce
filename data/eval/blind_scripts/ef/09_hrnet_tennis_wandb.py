"""HRNet-W32 on the tennis serve dataset (17 COCO joints + racket tip/butt = 19).

Runs are tracked in W&B (project "serve-pose").

    torchrun --nproc_per_node=4 hrnet_tennis_wandb.py --data /mnt/tennis --run-name w32_serve_v3
"""
import argparse
import json
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import flip_back, get_final_preds

NUM_JOINTS = 19
FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]
OKS_SIGMAS = np.array([.26, .25, .25, .35, .35, .79, .79, .72, .72, .62, .62, 1.07, 1.07, .87, .87, .89, .89,
                       .50, .50]) / 10.0


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/mnt/tennis")
    p.add_argument("--out", default="/mnt/tennis/runs")
    p.add_argument("--run-name", default="w32_serve")
    p.add_argument("--pretrained", default="weights/hrnet_w32_coco_256x192.pth")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=4)
    return p.parse_args()


class HRNetPose(nn.Module):
    def __init__(self, num_joints):
        super().__init__()
        self.backbone = timm.create_model("hrnet_w32", pretrained=False, features_only=True,
                                          feature_location="", out_indices=(1,))
        self.final_layer = nn.Conv2d(self.backbone.feature_info.channels()[0], num_joints, 1)

    def forward(self, x):
        return self.final_layer(self.backbone(x)[0])


def load_pretrained(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = {k.replace("module.", "", 1): v for k, v in sd.items() if not k.startswith(("final_layer", "module.final_layer"))}
    return model.load_state_dict(sd, strict=False)


@torch.no_grad()
def evaluate(model, loader, dataset, device, out_dir):
    model.eval()
    dets = []
    for img, _, _, meta in loader:
        img = img.to(device, non_blocking=True)
        hm = model(img)
        hm_f = torch.from_numpy(flip_back(model(img.flip(3)).cpu().numpy(), FLIP_PAIRS).copy()).to(device)
        hm_f[..., 1:] = hm_f.clone()[..., :-1]
        heat = ((hm + hm_f) / 2).cpu().numpy()
        kp, mv = get_final_preds(heat, meta["center"].numpy(), meta["scale"].numpy())
        for n in range(len(kp)):
            sel = mv[n, :17, 0] > 0.2
            dets.append({"index": int(meta["index"][n]), "image_id": int(meta["image_id"][n]), "category_id": 1,
                         "keypoints": np.concatenate([kp[n], mv[n]], 1).ravel().tolist(),
                         "score": float(mv[n, :17][sel, 0].mean()) if sel.any() else 0.0})
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dets)
    stats = torch.zeros(2, device=device)
    if dist.get_rank() == 0:
        uniq = {d.pop("index"): d for part in parts for d in part}
        path = os.path.join(out_dir, "val_dets.json")
        with open(path, "w") as f:
            json.dump(list(uniq.values()), f)
        E = COCOeval(dataset.coco, dataset.coco.loadRes(path), "keypoints")
        E.params.kpt_oks_sigmas = OKS_SIGMAS
        E.params.useSegm = None
        E.evaluate()
        E.accumulate()
        E.summarize()
        stats[0], stats[1] = E.stats[0], E.stats[1]
    dist.broadcast(stats, src=0)
    return stats[0].item(), stats[1].item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out_dir = os.path.join(args.out, args.run_name)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    run = wandb.init(project="serve-pose", name=args.run_name, config=vars(args), dir=args.out)
    run.config.update({"world_size": world_size, "global_batch": args.batch_size * world_size})

    kw = dict(image_size=[192, 256], sigma=2, flip_pairs=FLIP_PAIRS, num_joints=NUM_JOINTS)
    train_ds = TopDownCocoDataset(args.data, "annotations/train.json", "images", train=True, **kw)
    val_ds = TopDownCocoDataset(args.data, "annotations/val.json", "images", train=False, **kw)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 64, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=args.workers,
                        pin_memory=True)

    model = HRNetPose(NUM_JOINTS)
    load_pretrained(model, args.pretrained)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [60, 75], 0.1)

    best_ap, step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        agg = torch.zeros(2, device=device)
        for img, target, weight, _ in train_dl:
            img = img.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            weight = weight.to(device, non_blocking=True)
            out = model(img)
            b, k = out.shape[:2]
            loss = 0.5 * F.mse_loss(out.view(b, k, -1) * weight, target.view(b, k, -1) * weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": optimizer.param_groups[0]["lr"]}, step=step)
        scheduler.step()
        dist.all_reduce(agg)
        epoch_loss = (agg[0] / agg[1]).item()
        wandb.log({"train/epoch_loss": epoch_loss, "epoch": epoch, "time/epoch_s": time.time() - tic}, step=step)

        if (epoch + 1) % args.eval_every == 0 or epoch == args.epochs - 1:
            ap, ap50 = evaluate(model, val_dl, val_ds, device, out_dir)
            wandb.log({"val/AP": ap, "val/AP50": ap50}, step=step)
            if rank == 0 and ap > best_ap:
                best_ap = ap
                torch.save(model.module.state_dict(), os.path.join(out_dir, "best.pth"))
        if rank == 0:
            print(f"epoch {epoch}: loss {epoch_loss:.6f} best AP {best_ap:.4f}", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(out_dir, "last.pth"))

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
