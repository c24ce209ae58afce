"""Zero-shot CLIP classification over an ImageFolder, one process per GPU via mp.spawn.

    python 12_spawn_infer.py --data /datasets/imagenet/val --model openai/clip-vit-large-patch14

No launcher needed: the script spawns one worker per visible GPU and sets up the
rendezvous itself.
"""
import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder
from transformers import CLIPModel, CLIPProcessor

TEMPLATES = [
    "a photo of a {}.",
    "a blurry photo of a {}.",
    "a photo of the large {}.",
    "a photo of the small {}.",
    "a close-up photo of a {}.",
    "a bright photo of a {}.",
]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--class_names", default=None, help="json list, defaults to folder names")
    p.add_argument("--model", default="openai/clip-vit-base-patch32")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="results/clip_zeroshot.json")
    p.add_argument("--gpus", type=int, default=None)
    return p.parse_args()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ProcessorTransform:
    """Picklable wrapper so DataLoader workers can run the CLIP image preprocessing."""

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, img):
        return self.processor(images=img.convert("RGB"), return_tensors="pt")["pixel_values"][0]


class IndexedImageFolder(ImageFolder):
    def __getitem__(self, i):
        img, label = super().__getitem__(i)
        return img, label, i


@torch.no_grad()
def text_classifier(model, processor, class_names, device):
    weights = []
    for name in class_names:
        texts = [t.format(name) for t in TEMPLATES]
        enc = processor(text=texts, return_tensors="pt", padding=True).to(device)
        emb = model.get_text_features(**enc)
        emb = emb / emb.norm(dim=-1, keepdim=True)
        mean = emb.mean(dim=0)
        weights.append(mean / mean.norm())
    return torch.stack(weights, dim=1)  # [D, C]


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    processor = CLIPProcessor.from_pretrained(args.model)
    model = CLIPModel.from_pretrained(args.model, torch_dtype=torch.float16).to(device).eval()

    dataset = IndexedImageFolder(args.data, transform=ProcessorTransform(processor))
    if args.class_names:
        with open(args.class_names) as f:
            class_names = json.load(f)
    else:
        class_names = [c.replace("_", " ") for c in dataset.classes]
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, persistent_workers=False)

    classifier = text_classifier(model, processor, class_names, device)

    records = []
    t0 = time.time()
    with torch.no_grad():
        for step, (pixels, labels, idx) in enumerate(loader):
            pixels = pixels.to(device, dtype=torch.float16, non_blocking=True)
            feats = model.get_image_features(pixel_values=pixels)
            feats = feats / feats.norm(dim=-1, keepdim=True)
            logits = 100.0 * feats @ classifier
            top5 = logits.topk(5, dim=-1).indices.cpu()
            for i, y, t5 in zip(idx.tolist(), labels.tolist(), top5.tolist()):
                records.append((i, y, t5))
            if rank == 0 and step % 20 == 0:
                print(f"[{time.time() - t0:6.0f}s] {step}/{len(loader)}", flush=True)

    gathered = [None] * world_size
    dist.all_gather_object(gathered, records)

    if rank == 0:
        seen = {}
        for part in gathered:
            for i, y, t5 in part:
                seen[i] = (y, t5)  # the sampler repeats a few indices to even out ranks
        assert len(seen) == len(dataset)
        top1 = sum(t5[0] == y for y, t5 in seen.values()) / len(seen)
        top5 = sum(y in t5 for y, t5 in seen.values()) / len(seen)
        result = {"model": args.model, "n": len(seen), "top1": top1, "top5": top5,
                  "seconds": round(time.time() - t0, 1), "gpus": world_size}
        print(json.dumps(result, indent=2))
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    dist.barrier()
    dist.destroy_process_group()


def main():
    args = parse_args()
    n_gpus = torch.cuda.device_count()
    world_size = min(args.gpus, n_gpus) if args.gpus else n_gpus
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
