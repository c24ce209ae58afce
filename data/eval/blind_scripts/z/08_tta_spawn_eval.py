"""
Multi-GPU test-time-augmentation evaluation for a trained image classifier.

Each GPU gets a slice of the test set, runs (multi-scale x hflip) TTA, and the per-image
averaged probabilities are gathered to rank 0, which writes submission.csv and reports
accuracy / macro-F1 when ground truth is available.

    python 08_tta_spawn_eval.py --data /data/plant_seedlings/test --ckpt runs/effnet_b3/best.pth \
        --arch efficientnet_b3 --num-classes 12 --scales 288 320 352
"""
import argparse
import csv
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import classification_report, f1_score
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import transforms


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder of images, or class sub-folders if --labeled")
    ap.add_argument("--labeled", action="store_true")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--arch", default="efficientnet_b3")
    ap.add_argument("--num-classes", type=int, default=12)
    ap.add_argument("--classes-file", default="")
    ap.add_argument("--scales", type=int, nargs="+", default=[288, 320, 352])
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="tta_out")
    ap.add_argument("--port", type=str, default="29533")
    return ap.parse_args()


class ImageList(Dataset):
    IMG_EXT = (".jpg", ".jpeg", ".png", ".bmp", ".webp")

    def __init__(self, root, labeled):
        self.samples = []
        if labeled:
            self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
            for ci, c in enumerate(self.classes):
                for fn in sorted(os.listdir(os.path.join(root, c))):
                    if fn.lower().endswith(self.IMG_EXT):
                        self.samples.append((os.path.join(root, c, fn), ci))
        else:
            self.classes = None
            for fn in sorted(os.listdir(root)):
                if fn.lower().endswith(self.IMG_EXT):
                    self.samples.append((os.path.join(root, fn), -1))
        self.to_tensor = transforms.Compose([
            transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ])
        self.base_size = 384

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        img = Image.open(path).convert("RGB").resize((self.base_size, self.base_size), Image.BICUBIC)
        return i, self.to_tensor(img), label


def load_model(arch, num_classes, ckpt_path, device):
    model = timm.create_model(arch, pretrained=False, num_classes=num_classes)
    state = torch.load(ckpt_path, map_location="cpu")
    state = state.get("model", state.get("state_dict", state))
    state = {k.replace("module.", "", 1): v for k, v in state.items()}
    model.load_state_dict(state)
    return model.to(device).eval()


@torch.no_grad()
def tta_predict(model, x, scales):
    probs = 0
    for s in scales:
        xs = F.interpolate(x, size=(s, s), mode="bilinear", align_corners=False)
        for flip in (False, True):
            inp = torch.flip(xs, dims=[3]) if flip else xs
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(inp)
            probs = probs + logits.float().softmax(dim=1)
    return probs / (2 * len(scales))


def eval_worker(local_rank, args, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size)
    device = torch.device("cuda", local_rank)

    dataset = ImageList(args.data, args.labeled)
    shard = Subset(dataset, list(range(local_rank, len(dataset), world_size)))
    loader = DataLoader(shard, batch_size=args.batch_size, shuffle=False,
                        num_workers=args.workers, pin_memory=True)
    model = load_model(args.arch, args.num_classes, args.ckpt, device)

    t0 = time.time()
    results = []
    for step, (idx, imgs, labels) in enumerate(loader):
        probs = tta_predict(model, imgs.to(device, non_blocking=True), args.scales).cpu()
        for i, p in zip(idx.tolist(), probs.numpy()):
            results.append((i, p.astype(np.float32)))
        if local_rank == 0 and step % 20 == 0:
            print(f"[rank0] {step}/{len(loader)} batches, {time.time() - t0:.1f}s", flush=True)

    gathered = [None] * world_size if local_rank == 0 else None
    dist.gather_object(results, gathered, dst=0)

    if local_rank == 0:
        merged = sorted((r for part in gathered for r in part), key=lambda r: r[0])
        assert len(merged) == len(dataset), (len(merged), len(dataset))
        probs = np.stack([p for _, p in merged])
        preds = probs.argmax(1)
        class_names = dataset.classes
        if class_names is None and args.classes_file:
            with open(args.classes_file) as f:
                class_names = [l.strip() for l in f if l.strip()]

        os.makedirs(args.out, exist_ok=True)
        np.save(os.path.join(args.out, "tta_probs.npy"), probs)
        with open(os.path.join(args.out, "submission.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["file", "species"])
            for (path, _), p in zip(dataset.samples, preds):
                w.writerow([os.path.basename(path), class_names[p] if class_names else int(p)])

        if args.labeled:
            y = np.array([lab for _, lab in dataset.samples])
            acc = (preds == y).mean()
            mf1 = f1_score(y, preds, average="macro")
            print(f"TTA ({len(args.scales)} scales x 2 flips): acc={acc:.4f} macro-F1={mf1:.4f}")
            print(classification_report(y, preds, target_names=class_names, digits=4))
        print(f"done in {time.time() - t0:.1f}s, wrote {args.out}/submission.csv")

    dist.destroy_process_group()


def main():
    args = parse_args()
    world_size = torch.cuda.device_count()
    print(f"running TTA eval on {world_size} GPUs")
    mp.spawn(eval_worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
