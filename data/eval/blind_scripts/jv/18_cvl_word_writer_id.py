"""Closed-set writer identification on CVL word images (FragNet-like setting).

Training and test use different pages of the same 310 writers. Each word image is
classified; page-level identification averages the word posteriors of a page.

    torchrun --nproc_per_node=4 18_cvl_word_writer_id.py --words /data/cvl/words --out runs/cvl_wordid
"""
import argparse
import glob
import logging
import os
import re
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# CVL word files: <writer>-<page>-<line>-<word>-<text>.tif, pages 1..7 (6 for some writers)
WORD = re.compile(r"(\d{4})-(\d)-(\d+)-(\d+)-")
TEST_PAGES = {"3", "4"}
log = logging.getLogger("wordid")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", required=True)
    ap.add_argument("--out", default="runs/cvl_wordid")
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=256, help="global")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def scan(root):
    train, test = [], []
    for p in sorted(glob.glob(os.path.join(root, "**", "*.tif"), recursive=True)):
        m = WORD.match(os.path.basename(p))
        if not m:
            continue
        writer, page = m.group(1), m.group(2)
        (test if page in TEST_PAGES else train).append((p, writer, f"{writer}-{page}"))
    return train, test


class Words(Dataset):
    def __init__(self, items, w2i, page2i, h, w, train):
        self.items, self.w2i, self.page2i = items, w2i, page2i
        aug = [T.RandomAffine(4, translate=(0.05, 0.05), shear=8, fill=255)] if train else []
        self.tf = T.Compose([*aug, T.Resize((h, w)), T.ToTensor(), T.Normalize([0.9], [0.2])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, writer, page = self.items[i]
        return self.tf(Image.open(p).convert("L")), self.w2i[writer], self.page2i.get(page, -1), i


class FragNetLite(nn.Module):
    def __init__(self, n_writers):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True),
                                 nn.Conv2d(o, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(True),
                                 nn.MaxPool2d(2))

        self.stages = nn.Sequential(block(1, 64), block(64, 128), block(128, 256), block(256, 512))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.4)
        self.fc = nn.Linear(512, n_writers)

    def forward(self, x):
        return self.fc(self.drop(self.pool(self.stages(x)).flatten(1)))


@torch.no_grad()
def evaluate(model, loader, device, world, n_pages):
    model.eval()
    probs, writers, pages, idx = [], [], [], []
    for x, w, pg, i in loader:
        probs.append(F.softmax(model(x.to(device, non_blocking=True)), dim=1))
        writers.append(w.to(device))
        pages.append(pg.to(device))
        idx.append(i.to(device))
    local = [torch.cat(probs), torch.cat(writers), torch.cat(pages), torch.cat(idx)]
    full = []
    for t in local:
        out = t.new_empty((world * t.shape[0],) + t.shape[1:])
        dist.all_gather_into_tensor(out, t.contiguous())
        full.append(out)
    probs, writers, pages, idx = full
    keep = torch.from_numpy(np.unique(idx.cpu().numpy(), return_index=True)[1]).to(device)
    probs, writers, pages = probs[keep], writers[keep], pages[keep]
    word_top1 = (probs.argmax(1) == writers).float().mean().item()
    page_scores = torch.zeros(n_pages, probs.shape[1], device=device).index_add_(0, pages, probs.log())
    page_writer = torch.zeros(n_pages, dtype=torch.long, device=device).scatter_(0, pages, writers)
    page_top1 = (page_scores.argmax(1) == page_writer).float().mean().item()
    model.train()
    return word_top1, page_top1


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    train_items, test_items = scan(args.words)
    w2i = {w: i for i, w in enumerate(sorted({w for _, w, _ in train_items}))}
    test_items = [it for it in test_items if it[1] in w2i]
    page2i = {pg: i for i, pg in enumerate(sorted({pg for _, _, pg in test_items}))}
    log.info("%d train words, %d test words, %d writers, %d test pages",
             len(train_items), len(test_items), len(w2i), len(page2i))

    train_ds = Words(train_items, w2i, {}, args.height, args.width, train=True)
    test_ds = Words(test_items, w2i, page2i, args.height, args.width, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size // world, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=256, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(FragNetLite(len(w2i))).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader))
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    best = 0.0
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        t0 = time.time()
        tot = torch.zeros(3, device=device)
        for x, y, _, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = crit(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum().float(),
                                torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(tot)
        word_acc, page_acc = evaluate(model, test_loader, device, world, len(page2i))
        log.info("epoch %d (%.0fs): train loss %.4f acc %.4f | test word top-1 %.4f page top-1 %.4f",
                 epoch, time.time() - t0, (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item(), word_acc, page_acc)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "writers": w2i, "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if page_acc > best:
                best = page_acc
                torch.save({"model": model.module.state_dict(), "writers": w2i, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
