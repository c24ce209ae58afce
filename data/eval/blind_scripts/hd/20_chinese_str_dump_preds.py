"""
Chinese scene-text line recognition (ReCTS + LSVT + ArT crops), MobileNetV3 + BiLSTM + CTC.
After every evaluation the full list of predictions is written to <out>/val_preds_epochN.tsv so the
data team can mine label errors.

    torchrun --nproc_per_node=8 20_chinese_str_dump_preds.py --keys ppocr_keys_v1.txt \
        --train-list /data/zh_rec/train.txt --val-list /data/zh_rec/val.txt --out /data/zh_rec/runs/mbv3_crnn
"""
import argparse
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import mobilenet_v3_small


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--keys", required=True)
    p.add_argument("--train-list", required=True)
    p.add_argument("--val-list", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--img-h", type=int, default=32)
    p.add_argument("--img-w", type=int, default=320)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args()


def load_keys(path):
    with open(path, encoding="utf-8") as f:
        keys = [l.rstrip("\r\n") for l in f]
    return keys + [" "]


class RecList(Dataset):
    """list file: image_path \t label"""

    def __init__(self, list_file, keys, h, w, train):
        base = os.path.dirname(list_file)
        self.items = []
        with open(list_file, encoding="utf-8") as f:
            for line in f:
                path, label = line.rstrip("\n").split("\t", 1)
                self.items.append((os.path.join(base, path), label))
        self.k2i = {k: i + 1 for i, k in enumerate(keys)}
        self.h, self.w, self.train = h, w, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        img = cv2.imread(path)
        if img is None:
            img = np.zeros((self.h, self.w, 3), np.uint8)
        h, w = img.shape[:2]
        nw = min(self.w, int(np.ceil(self.h * w / h)))
        img = cv2.resize(img, (nw, self.h)).astype(np.float32)
        if self.train and np.random.rand() < 0.4:
            img = img * np.random.uniform(0.7, 1.3) + np.random.uniform(-20, 20)
        img = (np.clip(img, 0, 255) / 255.0 - 0.5) / 0.5
        canvas = np.zeros((self.h, self.w, 3), np.float32)
        canvas[:, :nw] = img
        ids = [self.k2i[c] for c in label if c in self.k2i][: self.w // 4 // 2]
        return torch.from_numpy(canvas.transpose(2, 0, 1)), torch.tensor(ids, dtype=torch.long), i


def collate(batch):
    x, y, idx = zip(*batch)
    return torch.stack(x), torch.cat(y), torch.tensor([len(t) for t in y]), torch.tensor(idx)


class MBV3CRNN(nn.Module):
    def __init__(self, n_cls):
        super().__init__()
        feats = mobilenet_v3_small(weights="IMAGENET1K_V1").features
        # keep width resolution: switch late strides to (2, 1)
        for m in feats.modules():
            if isinstance(m, nn.Conv2d) and m.stride == (2, 2) and m.in_channels >= 24:
                m.stride = (2, 1)
        self.backbone = feats
        self.pool = nn.AdaptiveAvgPool2d((1, None))
        self.rnn = nn.LSTM(576, 128, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(256, n_cls)

    def forward(self, x):
        f = self.pool(self.backbone(x)).squeeze(2).transpose(1, 2)
        f, _ = self.rnn(f)
        return self.fc(f)


def greedy_ids(logits):
    out = []
    for row in logits.argmax(-1):
        keep = torch.ones_like(row, dtype=torch.bool)
        keep[1:] = row[1:] != row[:-1]
        out.append(row[keep & (row != 0)])
    return out


@torch.no_grad()
def evaluate(net, loader, device, world):
    net.eval()
    pred_ids, sample_idx = [], []
    for x, _, _, idx in loader:
        pred_ids.extend(greedy_ids(net(x.to(device))))
        sample_idx.append(idx.to(device))
    preds_t = pad_sequence(pred_ids, batch_first=True, padding_value=-1)
    idx_t = torch.cat(sample_idx)
    all_preds = [torch.zeros_like(preds_t) for _ in range(world)]
    all_idx = [torch.zeros_like(idx_t) for _ in range(world)]
    dist.all_gather(all_preds, preds_t)
    dist.all_gather(all_idx, idx_t)
    net.train()
    return torch.cat([p.cpu() for p in all_preds]), torch.cat([i.cpu() for i in all_idx])


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    keys = load_keys(args.keys)
    train_ds = RecList(args.train_list, keys, args.img_h, args.img_w, True)
    val_ds = RecList(args.val_list, keys, args.img_h, args.img_w, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=8, collate_fn=collate,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), 256,
                        num_workers=4, collate_fn=collate)

    model = DDP(MBV3CRNN(len(keys) + 1).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl), eta_min=1e-6)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (x, y, ylen, _) in enumerate(train_dl):
            x = x.to(device, non_blocking=True)
            lp = F.log_softmax(model(x), -1).transpose(0, 1)
            loss = ctc(lp, y, torch.full((x.size(0),), lp.size(0), dtype=torch.long), ylen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        preds, idxs = evaluate(model.module, val_dl, device, world)
        if rank == 0:
            correct, lines = 0, []
            for row, i in zip(preds.tolist(), idxs.tolist()):
                text = "".join(keys[k - 1] for k in row if k > 0)
                gt = val_ds.items[i][1]
                correct += int(text == gt)
                lines.append(f"{val_ds.items[i][0]}\t{gt}\t{text}")
            acc = correct / len(val_ds)
            with open(os.path.join(args.out, f"val_preds_epoch{epoch}.tsv"), "w", encoding="utf-8") as f:
                f.write("\n".join(lines))
            print(f"epoch {epoch} line acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, "last.pth"))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
