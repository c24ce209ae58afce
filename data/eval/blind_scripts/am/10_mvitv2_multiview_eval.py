"""Evaluate an MViTv2-S checkpoint on Kinetics-400 val with 5 clips x 3 crops per video.

Each dataset item is one video with all of its 15 views stacked; views are run through
the network in chunks and their softmax scores averaged into one prediction per video.

    torchrun --nproc_per_node=8 10_mvitv2_multiview_eval.py --ckpt work_dirs/mvitv2_s/best.pth \
        --video-root /data/k400/val --ann /data/k400/val.csv --save-dir eval/mvitv2_s
"""
import argparse
import csv
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.models.video import mvit_v2_s


def load_classes(ann):
    with open(ann) as f:
        rows = list(csv.DictReader(f))
    names = sorted({r["label"] for r in rows})
    return rows, {n: i for i, n in enumerate(names)}


class VideoViews(Dataset):
    def __init__(self, video_root, rows, class_to_idx, num_frames=16, rate=4, size=224, clips=5, crops=3):
        self.video_root, self.rows, self.class_to_idx = video_root, rows, class_to_idx
        self.num_frames, self.rate, self.size, self.clips, self.crops = num_frames, rate, size, clips, crops
        self.mean = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
        self.std = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.rows)

    def _path(self, r):
        return os.path.join(self.video_root, r["label"], f"{r['youtube_id']}_{int(r['time_start']):06d}_"
                                                         f"{int(r['time_end']):06d}.mp4")

    def __getitem__(self, i):
        r = self.rows[i]
        label = self.class_to_idx[r["label"]]
        try:
            vr = VideoReader(self._path(r), ctx=cpu(0), width=-1, height=-1)
        except Exception:
            return torch.zeros(0), label, i
        n, span = len(vr), self.num_frames * self.rate
        starts = np.linspace(0, max(n - span, 0), self.clips).astype(int)
        idx = np.concatenate([np.clip(np.arange(s, s + span, self.rate), 0, n - 1) for s in starts])
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0  # C, clips*T, H, W
        h, w = x.shape[-2:]
        scale = self.size / min(h, w)
        x = F.interpolate(x, size=(round(h * scale), round(w * scale)), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        views = []
        for c in range(self.clips):
            clip = x[:, c * self.num_frames:(c + 1) * self.num_frames]
            for k in range(self.crops):
                if w >= h:
                    x0 = [0, (w - self.size) // 2, w - self.size][k]
                    v = clip[..., :, x0:x0 + self.size]
                else:
                    y0 = [0, (h - self.size) // 2, h - self.size][k]
                    v = clip[..., y0:y0 + self.size, :]
                views.append((v - self.mean) / self.std)
        return torch.stack(views), label, i          # V C T H W


@torch.no_grad()
def predict(model, loader, device, chunk=15):
    model.eval()
    preds, labels, ids, skipped = [], [], [], 0
    t0 = time.time()
    for step, (views, label, idx) in enumerate(loader):
        views = views[0]
        if views.numel() == 0:
            skipped += 1
            continue
        probs = []
        for s in range(0, views.shape[0], chunk):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(views[s:s + chunk].to(device, non_blocking=True))
            probs.append(logits.float().softmax(-1))
        preds.append(torch.cat(probs).mean(0))
        labels.append(label[0])
        ids.append(int(idx[0]))
        if step % 500 == 0 and dist.get_rank() == 0:
            print(f"[{step}/{len(loader)}] {time.time() - t0:.0f}s", flush=True)
    return torch.stack(preds).cpu(), torch.tensor(labels), ids, skipped


def topk_accuracy(preds, labels, ks=(1, 5)):
    top = preds.topk(max(ks), dim=1).indices
    return {f"top{k}": 100.0 * (top[:, :k] == labels[:, None]).any(1).float().mean().item() for k in ks}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--video-root", required=True)
    ap.add_argument("--ann", required=True)
    ap.add_argument("--save-dir", default="eval/mvitv2_s")
    ap.add_argument("--clips", type=int, default=5)
    ap.add_argument("--crops", type=int, default=3)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    rows, class_to_idx = load_classes(args.ann)
    dataset = VideoViews(args.video_root, rows, class_to_idx, clips=args.clips, crops=args.crops)
    shard = Subset(dataset, list(range(rank, len(dataset), world)))
    loader = DataLoader(shard, batch_size=1, num_workers=args.workers, pin_memory=True)

    model = mvit_v2_s(num_classes=len(class_to_idx))
    state = torch.load(args.ckpt, map_location="cpu")
    state = state.get("model_ema", state.get("model", state))
    model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    model.to(device)

    preds, labels, ids, skipped = predict(model, loader, device)
    metrics = topk_accuracy(preds, labels)
    metrics.update(num_videos=len(ids), unreadable=skipped, views=f"{args.clips}x{args.crops}")

    os.makedirs(args.save_dir, exist_ok=True)
    torch.save({"preds": preds, "labels": labels, "ids": ids},
               os.path.join(args.save_dir, f"preds_rank{rank}.pt"))
    if rank == 0:
        print(json.dumps(metrics, indent=2))
        with open(os.path.join(args.save_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
