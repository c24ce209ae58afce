"""Multi-view (10 temporal clips x 3 spatial crops) testing of a SlowFast R50 on Kinetics-400.

Each (video, view) pair is one dataset item; views of the same video are spread over
ranks and the per-video softmax scores are summed on all ranks, then averaged.

    torchrun --nproc_per_node=8 03_slowfast_multiview_test.py \
        --checkpoint runs/slowfast_r50/best.pth --data-root /data/k400 --test-list val.txt
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from decord import VideoReader, cpu
from pytorchvideo.models.slowfast import create_slowfast
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

MEAN = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
STD = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)


class MultiViewKinetics(Dataset):
    def __init__(self, root, list_file, num_frames=32, rate=2, short_side=256, crop=256,
                 num_clips=10, num_crops=3, alpha=4):
        self.root = root
        self.num_frames, self.rate = num_frames, rate
        self.short_side, self.crop = short_side, crop
        self.num_clips, self.num_crops, self.alpha = num_clips, num_crops, alpha
        self.videos, self.labels = [], []
        with open(list_file) as f:
            for line in f:
                path, label = line.rsplit(maxsplit=1)
                self.videos.append(path)
                self.labels.append(int(label))
        self.views = num_clips * num_crops

    def __len__(self):
        return len(self.videos) * self.views

    def _temporal_index(self, n, clip_idx):
        span = self.num_frames * self.rate
        delta = max(n - span, 0)
        start = int(round(delta * clip_idx / max(self.num_clips - 1, 1)))
        return np.clip(np.arange(start, start + span, self.rate), 0, n - 1)

    def _spatial_crop(self, clip, crop_idx):
        _, _, h, w = clip.shape
        if h < w:
            nh, nw = self.short_side, int(w * self.short_side / h)
        else:
            nh, nw = int(h * self.short_side / w), self.short_side
        clip = F.interpolate(clip, size=(nh, nw), mode="bilinear", align_corners=False)
        # crops along the long side: 0 = left/top, 1 = center, 2 = right/bottom
        if nw >= nh:
            off = [0, (nw - self.crop) // 2, nw - self.crop][crop_idx]
            return clip[:, :, (nh - self.crop) // 2:(nh - self.crop) // 2 + self.crop, off:off + self.crop]
        off = [0, (nh - self.crop) // 2, nh - self.crop][crop_idx]
        return clip[:, :, off:off + self.crop, (nw - self.crop) // 2:(nw - self.crop) // 2 + self.crop]

    def __getitem__(self, item):
        vid, view = divmod(item, self.views)
        clip_idx, crop_idx = divmod(view, self.num_crops)
        valid = 1
        try:
            vr = VideoReader(os.path.join(self.root, self.videos[vid]), ctx=cpu(0), num_threads=1)
            frames = vr.get_batch(self._temporal_index(len(vr), clip_idx)).asnumpy()
            clip = torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 255.0
            clip = (self._spatial_crop(clip, crop_idx) - MEAN) / STD
        except Exception:
            # unreadable video: keep the slot so every rank sees the same number of items
            clip = torch.zeros(3, self.num_frames, self.crop, self.crop)
            valid = 0
        slow = clip[:, :: self.alpha].contiguous()
        return [slow, clip], self.labels[vid], vid, valid


def load_weights(model, path):
    ckpt = torch.load(path, map_location="cpu")
    state = ckpt.get("model_state", ckpt.get("model", ckpt))
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"checkpoint mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")


@torch.no_grad()
def run_test(model, dataset, args, device, rank, world):
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True)
    num_videos, num_classes = len(dataset.videos), args.num_classes
    video_scores = torch.zeros(num_videos, num_classes, device=device)
    view_counts = torch.zeros(num_videos, device=device)
    labels_t = torch.tensor(dataset.labels, device=device)

    # DistributedSampler (shuffle=False) pads by repeating the first items; position p on
    # this rank corresponds to global slot p * world + rank, anything past len(dataset) is padding
    seen, t0 = 0, time.time()
    for it, (inputs, _, vids, valid) in enumerate(loader):
        inputs = [x.to(device, non_blocking=True) for x in inputs]
        vids, valid = vids.to(device), valid.to(device).float()
        with torch.autocast("cuda", dtype=torch.float16):
            probs = model(inputs).float().softmax(dim=1)
        slots = (seen + torch.arange(vids.numel(), device=device)) * world + rank
        keep = valid * (slots < len(dataset)).float()
        seen += vids.numel()
        video_scores.index_add_(0, vids, probs * keep[:, None])
        view_counts.index_add_(0, vids, keep)
        if rank == 0 and it % 200 == 0:
            log.info("batch %d/%d  %.1fs", it, len(loader), time.time() - t0)

    dist.all_reduce(video_scores)
    dist.all_reduce(view_counts)
    return video_scores, view_counts, labels_t


def summarize(video_scores, view_counts, labels, expected_views):
    has_view = view_counts > 0
    avg = video_scores / view_counts.clamp(min=1)[:, None]
    top5 = avg.topk(5, dim=1).indices
    hit1 = (top5[:, 0] == labels) & has_view
    hit5 = (top5 == labels[:, None]).any(1) & has_view
    n = labels.numel()
    per_class = []
    for c in labels.unique():
        m = labels == c
        per_class.append(hit1[m].float().mean().item())
    return {
        "videos": n,
        "videos_without_views": int((~has_view).sum()),
        "videos_with_partial_views": int(((view_counts > 0) & (view_counts < expected_views)).sum()),
        "top1": 100.0 * hit1.float().mean().item(),
        "top5": 100.0 * hit5.float().mean().item(),
        "mean_class_acc": 100.0 * float(np.mean(per_class)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--data-root", required=True)
    ap.add_argument("--test-list", required=True)
    ap.add_argument("--num-classes", type=int, default=400)
    ap.add_argument("--num-clips", type=int, default=10)
    ap.add_argument("--num-crops", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="results/slowfast_r50_k400_test.json")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")

    model = create_slowfast(model_num_class=args.num_classes)
    load_weights(model, args.checkpoint)
    model.to(device).eval()

    dataset = MultiViewKinetics(args.data_root, args.test_list, num_clips=args.num_clips,
                                num_crops=args.num_crops)
    log.info("%d videos x %d views on %d ranks", len(dataset.videos), dataset.views, world)
    scores, counts, labels = run_test(model, dataset, args, device, rank, world)

    if rank == 0:
        res = summarize(scores, counts, labels, dataset.views)
        res.update(checkpoint=args.checkpoint, views=f"{args.num_clips}x{args.num_crops}")
        log.info(json.dumps(res, indent=2))
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
        torch.save({"scores": (scores / counts.clamp(min=1)[:, None]).cpu(), "labels": labels.cpu()},
                   os.path.splitext(args.out)[0] + "_scores.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
