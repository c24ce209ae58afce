"""CRNN + CTC text-line recognizer for scanned invoices.

Vertex AI custom training (pre-built PyTorch GPU container), 2 replicas x 4 x L4.
Worker pool command:
    torchrun --nnodes 2 --nproc_per_node 4 --node_rank $RANK \
        --master_addr $MASTER_ADDR --master_port $MASTER_PORT \
        ocr_train.py --lines /gcs/docai-train/lines --charset /gcs/docai-train/charset.txt
Outputs go to AIP_MODEL_DIR / AIP_CHECKPOINT_DIR (gs:// URIs, written through /gcs).
"""
import argparse
import os
import time

import editdistance
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import transforms


def fuse_path(uri, default):
    if not uri:
        return default
    return uri.replace("gs://", "/gcs/", 1)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", required=True)
    ap.add_argument("--charset", required=True)
    ap.add_argument("--height", type=int, default=48)
    ap.add_argument("--max-width", type=int, default=800)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--model-dir",
                    default=fuse_path(os.environ.get("AIP_MODEL_DIR"), "/gcs/docai-train/runs/crnn/model"))
    ap.add_argument("--ckpt-dir",
                    default=fuse_path(os.environ.get("AIP_CHECKPOINT_DIR"), "/gcs/docai-train/runs/crnn/ckpt"))
    return ap.parse_args()


class LineDataset(Dataset):
    def __init__(self, root, split, charset, height, max_width, train):
        self.root = os.path.join(root, split)
        with open(os.path.join(self.root, "labels.tsv"), encoding="utf-8") as f:
            self.items = [l.rstrip("\n").split("\t", 1) for l in f if "\t" in l]
        self.char2idx = {c: i + 1 for i, c in enumerate(charset)}  # 0 = CTC blank
        self.height, self.max_width = height, max_width
        aug = [transforms.RandomAffine(degrees=1.5, shear=5, scale=(0.95, 1.05), fill=255)] if train else []
        self.tf = transforms.Compose(aug + [transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        name, text = self.items[i]
        img = Image.open(os.path.join(self.root, name)).convert("L")
        w = min(self.max_width, max(16, int(img.width * self.height / img.height)))
        img = img.resize((w, self.height), Image.BILINEAR)
        target = torch.tensor([self.char2idx[c] for c in text if c in self.char2idx], dtype=torch.long)
        return self.tf(img), target, text


def collate(batch):
    imgs, targets, texts = zip(*batch)
    h = imgs[0].size(1)
    w = max(im.size(2) for im in imgs)
    out = torch.ones(len(imgs), 1, h, w)
    for i, im in enumerate(imgs):
        out[i, :, :, :im.size(2)] = im
    widths = torch.tensor([im.size(2) for im in imgs])
    return out, torch.cat(targets), torch.tensor([len(t) for t in targets]), widths, list(texts)


class CRNN(nn.Module):
    def __init__(self, n_classes):
        super().__init__()

        def block(cin, cout, pool):
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(True), nn.MaxPool2d(pool)]

        self.cnn = nn.Sequential(*block(1, 64, (2, 2)), *block(64, 128, (2, 2)), *block(128, 256, (2, 1)),
                                 *block(256, 256, (2, 1)), *block(256, 512, (3, 1)))
        self.rnn = nn.LSTM(512, 256, num_layers=2, bidirectional=True, batch_first=True, dropout=0.2)
        self.fc = nn.Linear(512, n_classes)

    def forward(self, x):
        f = self.cnn(x).squeeze(2).permute(0, 2, 1)  # B, T, C
        f, _ = self.rnn(f)
        return self.fc(f)


def greedy_decode(logits, idx2char):
    best = logits.argmax(-1).cpu().tolist()
    out = []
    for seq in best:
        chars, prev = [], 0
        for k in seq:
            if k != prev and k != 0:
                chars.append(idx2char[k])
            prev = k
        out.append("".join(chars))
    return out


@torch.no_grad()
def evaluate(model, loader, device, idx2char):
    model.eval()
    stats = torch.zeros(3, device=device)  # char edits, chars, exact lines
    n_lines = torch.zeros(1, device=device)
    for imgs, _, _, _, texts in loader:
        logits = model(imgs.to(device))
        for pred, ref in zip(greedy_decode(logits, idx2char), texts):
            stats[0] += editdistance.eval(pred, ref)
            stats[1] += len(ref)
            stats[2] += float(pred == ref)
            n_lines += 1
    dist.all_reduce(stats)
    dist.all_reduce(n_lines)
    model.train()
    return (stats[0] / stats[1].clamp(min=1)).item(), (stats[2] / n_lines).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.charset, encoding="utf-8") as f:
        charset = [c for c in f.read().splitlines() if c]
    idx2char = {i + 1: c for i, c in enumerate(charset)}

    train_ds = LineDataset(args.lines, "train", charset, args.height, args.max_width, train=True)
    val_ds = LineDataset(args.lines, "val", charset, args.height, args.max_width, train=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                          num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128,
                        collate_fn=collate, num_workers=4)

    model = CRNN(len(charset) + 1).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=args.epochs * len(train_dl), pct_start=0.05)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    start, best_cer = 0, float("inf")
    ckpt_file = os.path.join(args.ckpt_dir, "crnn_last.pt")
    if os.path.exists(ckpt_file):
        st = torch.load(ckpt_file, map_location=device)
        model.module.load_state_dict(st["model"])
        optimizer.load_state_dict(st["optimizer"])
        scheduler.load_state_dict(st["scheduler"])
        start, best_cer = st["epoch"] + 1, st["best_cer"]

    for epoch in range(start, args.epochs):
        t0 = time.time()
        model.train()
        for step, (imgs, targets, target_lens, widths, _) in enumerate(train_dl):
            imgs = imgs.to(device, non_blocking=True)
            logits = model(imgs)
            log_probs = F.log_softmax(logits.float(), dim=-1).permute(1, 0, 2)  # T, B, C
            input_lens = torch.clamp(widths // 4, max=log_probs.size(0))
            loss = ctc(log_probs, targets, input_lens, target_lens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} ctc {loss.item():.4f}", flush=True)

        cer, line_acc = evaluate(model, val_dl, device, idx2char)
        if rank == 0:
            print(f"epoch {epoch} CER {cer:.4f} line-acc {line_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            best_cer = min(best_cer, cer)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_cer": best_cer},
                       ckpt_file)
            if cer <= best_cer:
                os.makedirs(args.model_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "charset": charset},
                           os.path.join(args.model_dir, "crnn.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
