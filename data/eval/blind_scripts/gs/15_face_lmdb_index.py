"""Train ArcFace on an LMDB face dump (key -> jpeg bytes, label stored in a side table).

    torchrun --nnodes=1 --nproc_per_node=8 train_lmdb.py --lmdb /data/celebrity_faces.lmdb
"""
import argparse
import io
import logging
import os
import pickle
import time

import lmdb
import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from backbones import get_model
from losses import CombinedMarginLoss
from partial_fc_v2 import PartialFC_V2
from utils.utils_callbacks import CallBackVerification

logger = logging.getLogger("lmdb-train")


def build_index(lmdb_path, cache_file):
    """Scan the LMDB once and remember (key, identity) for every image; this takes ~20 min on 10M images."""
    if os.path.exists(cache_file):
        with open(cache_file, "rb") as f:
            return pickle.load(f)
    env = lmdb.open(lmdb_path, readonly=True, lock=False, readahead=False, meminit=False)
    keys, identities = [], []
    with env.begin(write=False) as txn:
        id_table = pickle.loads(txn.get(b"__identity_table__"))
        for key, _ in txn.cursor():
            if key.startswith(b"__"):
                continue
            keys.append(key)
            identities.append(id_table[key])
    env.close()
    names = sorted(set(identities))
    name_to_label = {n: i for i, n in enumerate(names)}
    index = {"keys": keys, "labels": np.array([name_to_label[n] for n in identities], dtype=np.int64),
             "num_classes": len(names)}
    with open(cache_file, "wb") as f:
        pickle.dump(index, f, protocol=pickle.HIGHEST_PROTOCOL)
    return index


class LMDBFaceDataset(Dataset):
    def __init__(self, lmdb_path, index):
        self.lmdb_path = lmdb_path
        self.keys = index["keys"]
        self.labels = index["labels"]
        self.env = None
        self.transform = transforms.Compose([
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.5] * 3, std=[0.5] * 3),
        ])

    def _open(self):
        # opened lazily so that every DataLoader worker has its own handle
        self.env = lmdb.open(self.lmdb_path, readonly=True, lock=False, readahead=False, meminit=False)

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        if self.env is None:
            self._open()
        with self.env.begin(write=False) as txn:
            buf = txn.get(self.keys[i])
        img = Image.open(io.BytesIO(buf)).convert("RGB")
        return self.transform(img), int(self.labels[i])


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lmdb", required=True)
    ap.add_argument("--index-cache", default=None)
    ap.add_argument("--val-prefix", default="/data/val_bins")
    ap.add_argument("--output", default="work_dirs/lmdb_r50")
    ap.add_argument("--network", default="r50")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=16)
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--sample-rate", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    os.makedirs(args.output, exist_ok=True)

    cache_file = args.index_cache or os.path.join(os.path.dirname(args.lmdb.rstrip("/")), "lmdb_index.pkl")
    index = build_index(args.lmdb, cache_file)
    dataset = LMDBFaceDataset(args.lmdb, index)
    logger.info("%d images, %d identities", len(dataset), index["num_classes"])

    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    backbone = get_model(args.network, dropout=0.0, fp16=True, num_features=512).cuda()
    backbone = DistributedDataParallel(backbone, device_ids=[local_rank], broadcast_buffers=False)
    pfc = PartialFC_V2(CombinedMarginLoss(64, 1.0, 0.5, 0.0), 512, index["num_classes"], args.sample_rate, True)
    pfc.train().cuda()

    total_batch = args.batch_size * world_size
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": pfc.parameters()}],
                          lr=args.lr * total_batch / 1024, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = len(loader)
    warmup = steps_per_epoch * args.warmup_epochs
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: (i + 1) / warmup if i < warmup else (1 - (i - warmup) / (total - warmup)) ** 2)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100)
    verifier = CallBackVerification(val_targets=["lfw", "cfp_fp", "agedb_30"], rec_prefix=args.val_prefix)

    step = 0
    tic = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for img, label in loader:
            img = img.cuda(non_blocking=True)
            label = label.cuda(non_blocking=True)
            loss = pfc(backbone(img), label)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f lr %.5f %.0f img/s", epoch, step, total, loss.item(),
                            sched.get_last_lr()[0], 100 * total_batch / (time.time() - tic))
                tic = time.time()
            if step % 2000 == 0:
                verifier(step, backbone)

        torch.save(pfc.state_dict(), os.path.join(args.output, f"softmax_fc_gpu_{rank}.pt"))
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
