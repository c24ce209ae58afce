"""Fine-tune a COCO-pretrained HRNet-W32 on CrowdPose (14 joints) and test the best epoch.

    torchrun --nproc_per_node=4 11_crowdpose_finetune_hrnet.py \
        --init weights/pose_hrnet_w32_256x192_coco.pth --work-dir work_dirs/crowdpose_w32
    # test only
    torchrun --nproc_per_node=4 11_crowdpose_finetune_hrnet.py --test-only --work-dir work_dirs/crowdpose_w32
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from crowdposetools.coco import COCO
from crowdposetools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from pose.datasets import CrowdPoseTopDown
from pose.inference import get_final_preds, flip_heatmaps
from pose.models import PoseHRNet

NUM_JOINTS = 14
FLIP_PAIRS = [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]


def build_model(init=None):
    net = PoseHRNet(width=32, num_joints=NUM_JOINTS)
    if init:
        sd = torch.load(init, map_location="cpu")
        sd = {k: v for k, v in sd.items() if not k.startswith("final_layer.")}  # 17 -> 14 joints
        missing, unexpected = net.load_state_dict(sd, strict=False)
        print(f"init from {init}: missing {missing}, unexpected {len(unexpected)}")
    return net


def joints_mse(pred, target, weight):
    w = weight[:, :, None, None]
    return 0.5 * ((pred * w - target * w) ** 2).mean()


@torch.no_grad()
def predict(net, loader):
    net.eval()
    out = []
    for b in loader:
        img = b["img"].cuda(non_blocking=True)
        hm = net(img)
        hm = (hm + flip_heatmaps(net(img.flip(3)), FLIP_PAIRS, shift=True)) * 0.5
        preds, maxvals = get_final_preds(hm.cpu().numpy(), b["center"].numpy(), b["scale"].numpy())
        for i in range(preds.shape[0]):
            m = maxvals[i, :, 0]
            s = float(m[m > 0.2].mean()) if (m > 0.2).any() else 0.0
            out.append({"idx": int(b["idx"][i]), "image_id": int(b["image_id"][i]), "category_id": 1,
                        "keypoints": np.concatenate([preds[i], maxvals[i]], 1).reshape(-1).tolist(),
                        "score": s * float(b["bbox_score"][i])})
    return out


def crowdpose_eval(ann_file, dets, res_file):
    with open(res_file, "w") as f:
        json.dump(dets, f)
    gt = COCO(ann_file)
    ev = COCOeval(gt, gt.loadRes(res_file), "keypoints")
    ev.params.useSegm = None
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    names = ["AP", "AP50", "AP75", "AR", "AR50", "AR75", "AP_easy", "AP_medium", "AP_hard"]
    return dict(zip(names, [float(ev.stats[i]) for i in (0, 1, 2, 5, 6, 7, 8, 9, 10)]))


def gather_dets(local):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    uniq = {}
    for p in parts:
        for d in p:
            uniq[d.pop("idx")] = d
    return list(uniq.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="data/crowdpose")
    ap.add_argument("--init", default="")
    ap.add_argument("--work-dir", default="work_dirs/crowdpose_w32")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--test-only", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    os.makedirs(args.work_dir, exist_ok=True)
    best_path = os.path.join(args.work_dir, "best.pth")

    ann = lambda split: os.path.join(args.data_root, "json", f"crowdpose_{split}.json")
    img_dir = os.path.join(args.data_root, "images")
    test_set = CrowdPoseTopDown(ann("test"), img_dir, train=False,
                                det_file=os.path.join(args.data_root, "det", "crowdpose_test_det_yolov3.json"))
    test_loader = DataLoader(test_set, 64, sampler=DistributedSampler(test_set, shuffle=False), num_workers=6)

    if not args.test_only:
        train_set = CrowdPoseTopDown(ann("trainval"), img_dir, train=True)
        val_set = CrowdPoseTopDown(ann("val"), img_dir, train=False)
        sampler = DistributedSampler(train_set, shuffle=True)
        train_loader = DataLoader(train_set, args.batch, sampler=sampler, num_workers=8, pin_memory=True,
                                  drop_last=True)
        val_loader = DataLoader(val_set, 64, sampler=DistributedSampler(val_set, shuffle=False), num_workers=6)

        model = build_model(args.init if rank == 0 else None)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
        model = DDP(model, device_ids=[local_rank])
        head_params = [p for n, p in model.named_parameters() if "final_layer" in n]
        body_params = [p for n, p in model.named_parameters() if "final_layer" not in n]
        opt = torch.optim.Adam([{"params": body_params, "lr": args.lr},
                                {"params": head_params, "lr": args.lr * 10}])
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)

        best_ap = -1.0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            for it, b in enumerate(train_loader):
                img = b["img"].cuda(non_blocking=True)
                target = b["target"].cuda(non_blocking=True)
                weight = b["target_weight"].cuda(non_blocking=True)
                loss = joints_mse(model(img), target, weight)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if rank == 0 and it % 50 == 0:
                    print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.6f}", flush=True)
            sched.step()

            dets = gather_dets(predict(model, val_loader))
            if rank == 0:
                stats = crowdpose_eval(ann("val"), dets, os.path.join(args.work_dir, f"val_{epoch}.json"))
                print(f"epoch {epoch} ({time.time() - t0:.0f}s): {stats}", flush=True)
                if stats["AP"] > best_ap:
                    best_ap = stats["AP"]
                    torch.save(model.state_dict(), best_path)
                torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "opt": opt.state_dict()},
                           os.path.join(args.work_dir, "last.pth"))
            dist.barrier()
        del model, opt

    # test the best epoch on CrowdPose test with detector boxes
    net = build_model().cuda()
    net.load_state_dict(torch.load(best_path, map_location="cpu"))
    dets = gather_dets(predict(net, test_loader))
    if rank == 0:
        stats = crowdpose_eval(ann("test"), dets, os.path.join(args.work_dir, "test_results.json"))
        print("CrowdPose test:", json.dumps(stats, indent=1), flush=True)
        with open(os.path.join(args.work_dir, "test_metrics.json"), "w") as f:
            json.dump(stats, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
