"""ArcFace + Partial FC on WebFace12M stored as aligned JPEG folders (one folder per identity).

Listing ~12M files over NFS takes a long time, so the (path, label) index is cached next
to the data after the first scan.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node001:29400 \
        19_webface12m_folder_cache.py --root /nfs/datasets/WebFace12M
"""
import argparse
import logging
import os
import pickle
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from backbones import get_model
from losses import CombinedMarginLoss
from lr_scheduler import PolyScheduler
from partial_fc_v2 import PartialFC_V2


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/nfs/datasets/WebFace12M")
    p.add_argument("--network", default="r100")
    p.add_argument("--embedding-size", type=int, default=512)
    p.add_argument("--sample-rate", type=float, default=0.3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--output", default="/nfs/work_dirs/wf12m_r100")
    return p.parse_args()


def scan_identity_folders(root):
    identities = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    samples = []
    for label, ident in enumerate(identities):
        folder = os.path.join(root, ident)
        for name in sorted(os.listdir(folder)):
            if name.lower().endswith((".jpg", ".png")):
                samples.append((os.path.join(ident, name), label))
    return samples, len(identities)


class FolderFaceDataset(Dataset):
    def __init__(self, root, cache_name="index_cache.pkl"):
        self.root = root
        cache = os.path.join(root, cache_name)
        if os.path.isfile(cache):
            with open(cache, "rb") as f:
                self.samples, self.num_classes = pickle.load(f)
        else:
            self.samples, self.num_classes = scan_identity_folders(root)
            with open(cache, "wb") as f:
                pickle.dump((self.samples, self.num_classes), f, protocol=pickle.HIGHEST_PROTOCOL)
        self.paths = np.array([s[0] for s in self.samples])
        self.labels = np.array([s[1] for s in self.samples], dtype=np.int64)
        del self.samples

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        img = cv2.imread(os.path.join(self.root, self.paths[idx]))
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        if np.random.rand() < 0.5:
            img = img[:, ::-1]
        img = (np.ascontiguousarray(img, dtype=np.float32) / 255.0 - 0.5) / 0.5
        return torch.from_numpy(img.transpose(2, 0, 1)), int(self.labels[idx])


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [{rank}] %(message)s")

    t0 = time.time()
    dataset = FolderFaceDataset(args.root)
    logging.info("indexed %d images of %d identities in %.0fs", len(dataset), dataset.num_classes, time.time() - t0)
    sampler = DistributedSampler(dataset, shuffle=True, seed=2048)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)

    backbone = get_model(args.network, dropout=0.0, fp16=True, num_features=args.embedding_size).cuda()
    backbone = DDP(backbone, device_ids=[local_rank], bucket_cap_mb=16)
    backbone.train()
    margin = CombinedMarginLoss(64, 1.0, 0.5, 0.0, 0)
    module_pfc = PartialFC_V2(margin, args.embedding_size, dataset.num_classes, args.sample_rate, fp16=True)
    module_pfc.train().cuda()

    global_batch = args.batch_size * world
    lr = args.lr * global_batch / 512
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": module_pfc.parameters()}],
                          lr=lr, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = len(loader)
    scheduler = PolyScheduler(opt, base_lr=lr, max_steps=steps_per_epoch * args.epochs,
                              warmup_steps=steps_per_epoch * args.warmup_epochs)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100)
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for img, label in loader:
            img, label = img.cuda(non_blocking=True), label.cuda(non_blocking=True)
            emb = backbone(img)
            loss = module_pfc(emb, label)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scheduler.step()
            step += 1
            if step % 100 == 0 and rank == 0:
                logging.info("epoch %d step %d/%d loss %.3f lr %.5f %.0f img/s", epoch, step, steps_per_epoch * args.epochs,
                             loss.item(), scheduler.get_last_lr()[0], 100 * global_batch / (time.time() - tic))
                tic = time.time()

        torch.save({"epoch": epoch, "pfc": module_pfc.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(args.output, f"pfc_rank{rank:03d}.pt"))
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
