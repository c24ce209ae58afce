"""PCB (6 horizontal stripes) on Occluded-DukeMTMC, softmax training, re-evaluation of the best model at the end.

torchrun --nproc_per_node=4 15_reid_pcb_occluded_duke.py --data /data/Occluded_Duke --save-dir checkpoints/pcb_occ_duke
"""
import argparse
import glob
import logging
import os
import re

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("pcb")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/Occluded_Duke")
    ap.add_argument("--save-dir", default="checkpoints/pcb_occ_duke")
    ap.add_argument("--parts", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="new layers, global batch 64; backbone gets lr/10")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=5)
    return ap.parse_args()


def list_images(d, relabel=False):
    pat = re.compile(r"([-\d]+)_c(\d)")
    out = []
    for f in sorted(glob.glob(os.path.join(d, "*.jpg"))):
        pid, cam = map(int, pat.search(os.path.basename(f)).groups())
        out.append([f, pid, cam])
    if relabel:
        m = {p: i for i, p in enumerate(sorted({o[1] for o in out}))}
        for o in out:
            o[1] = m[o[1]]
    return [tuple(o) for o in out]


class PersonCrops(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, pid, cam = self.items[i]
        return self.tf(Image.open(f).convert("RGB")), pid, cam


class PCB(nn.Module):
    def __init__(self, num_classes, parts=6):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.parts = parts
        self.pool = nn.AdaptiveAvgPool2d((parts, 1))
        self.dropout = nn.Dropout(0.5)
        self.reduce = nn.ModuleList([nn.Sequential(nn.Conv2d(2048, 256, 1, bias=False), nn.BatchNorm2d(256),
                                                   nn.ReLU(inplace=True)) for _ in range(parts)])
        self.classifiers = nn.ModuleList([nn.Linear(256, num_classes) for _ in range(parts)])
        for c in self.classifiers:
            nn.init.normal_(c.weight, std=0.001)
            nn.init.zeros_(c.bias)

    def forward(self, x):
        stripes = self.pool(self.backbone(x))  # B x 2048 x parts x 1
        feats = [self.reduce[i](stripes[:, :, i:i + 1]).flatten(1) for i in range(self.parts)]
        if not self.training:
            return torch.cat([F.normalize(f, dim=1) for f in feats], dim=1)
        return [cls(self.dropout(f)) for cls, f in zip(self.classifiers, feats)]


@torch.no_grad()
def evaluate(model, query, gallery, tf, device):
    model.eval()

    def embed(items):
        dl = DataLoader(PersonCrops(items, tf), batch_size=128, num_workers=8, pin_memory=True)
        out = []
        for x, _, _ in dl:
            x = x.to(device, non_blocking=True)
            out.append(model(x) + model(x.flip(3)))
        return F.normalize(torch.cat(out), dim=1)

    qf, gf = embed(query), embed(gallery)
    scores = (qf @ gf.t()).cpu().numpy()
    qp, qc = np.array([q[1] for q in query]), np.array([q[2] for q in query])
    gp, gc = np.array([g[1] for g in gallery]), np.array([g[2] for g in gallery])
    cmc, aps = np.zeros(len(gallery)), []
    for i in range(len(query)):
        order = np.argsort(-scores[i])
        keep = ~((gp[order] == qp[i]) & (gc[order] == qc[i]))
        good = gp[order][keep] == qp[i]
        if not good.any():
            continue
        cmc[np.argmax(good):] += 1
        pos = np.flatnonzero(good)
        aps.append(np.mean(np.arange(1, len(pos) + 1) / (pos + 1)))
    cmc /= len(aps)
    return cmc[0], cmc[4], float(np.mean(aps))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")

    train = list_images(os.path.join(args.data, "bounding_box_train"), relabel=True)
    query = list_images(os.path.join(args.data, "query"))
    gallery = list_images(os.path.join(args.data, "bounding_box_test"))
    num_classes = len({t[1] for t in train})

    train_tf = T.Compose([T.Resize((384, 128), interpolation=T.InterpolationMode.BICUBIC), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    test_tf = T.Compose([T.Resize((384, 128), interpolation=T.InterpolationMode.BICUBIC), T.ToTensor(),
                         T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    train_set = PersonCrops(train, train_tf)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(PCB(num_classes, args.parts)).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 64
    backbone_ids = {id(p) for p in model.module.backbone.parameters()}
    new_params = [p for p in model.parameters() if id(p) not in backbone_ids]
    optimizer = torch.optim.SGD([{"params": model.module.backbone.parameters(), "lr": lr * 0.1},
                                 {"params": new_params, "lr": lr}], momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=40, gamma=0.1)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best_path = os.path.join(args.save_dir, "pcb_best.pth")
    best_map = -1.0

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(3, device=device)
        for img, pid, _ in loader:
            img, pid = img.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            logits = model(img)
            loss = sum(F.cross_entropy(l, pid) for l in logits)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            acc = torch.stack([(l.argmax(1) == pid).float().mean() for l in logits]).mean()
            stats += torch.stack([loss.detach(), acc, torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(stats)
        log.info("epoch %d loss %.4f acc %.3f", epoch + 1, stats[0] / stats[2], stats[1] / stats[2])

        if rank == 0 and (epoch + 1) % args.eval_every == 0:
            r1, r5, mAP = evaluate(model.module, query, gallery, test_tf, device)
            log.info("epoch %d: rank-1 %.2f rank-5 %.2f mAP %.2f", epoch + 1, 100 * r1, 100 * r5, 100 * mAP)
            if mAP > best_map:
                best_map = mAP
                torch.save(model.state_dict(), best_path)
                log.info("saved best model to %s", best_path)
        dist.barrier()

    if rank == 0:
        final = PCB(num_classes, args.parts).to(device)
        final.load_state_dict(torch.load(best_path, map_location="cpu"))
        r1, r5, mAP = evaluate(final, query, gallery, test_tf, device)
        log.info("best model: rank-1 %.2f rank-5 %.2f mAP %.2f", 100 * r1, 100 * r5, 100 * mAP)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
