"""CSL-Daily continuous sign recognition: ResNet-34 frames + temporal conv + BiLSTM,
CTC on both the temporal-conv output (auxiliary) and the BiLSTM output.

Frames are stored per split in one HDF5 file (group per video, uint8 JPEG bytes).

    torchrun --nproc_per_node=8 06_csl_daily_r34_tconv_ctc.py --h5 /data/csl_daily/frames_{split}.h5
"""
import argparse
import io
import os
import random

import h5py
import jiwer
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
import torchvision.transforms.functional as TF
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class H5SignVideos(Dataset):
    def __init__(self, h5_path, ann_path, gloss2id, train):
        self.h5_path = h5_path
        self.h5 = None  # opened lazily inside each worker
        with open(ann_path, encoding="utf-8") as f:
            self.anns = [line.rstrip("\n").split("|") for line in f if line.strip()]  # name|gloss gloss ...
        self.gloss2id = gloss2id
        self.train = train

    def __len__(self):
        return len(self.anns)

    def __getitem__(self, i):
        if self.h5 is None:
            self.h5 = h5py.File(self.h5_path, "r")
        name, gloss = self.anns[i]
        jpegs = self.h5[name]
        n = len(jpegs)
        if self.train:
            keep = sorted(random.sample(range(n), k=max(16, int(n * random.uniform(0.8, 1.0)))))
        else:
            keep = list(range(n))
        imgs = [TF.to_tensor(Image.open(io.BytesIO(jpegs[k][()])).convert("RGB")) for k in keep]
        video = torch.stack(imgs)
        if self.train:
            i0, j0 = random.randint(0, 32), random.randint(0, 32)
        else:
            i0 = j0 = 16
        video = TF.normalize(video[:, :, i0:i0 + 224, j0:j0 + 224], [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        return video, torch.tensor([self.gloss2id[g] for g in gloss.split()])


def collate(batch):
    videos, labels = zip(*batch)
    lengths = torch.tensor([v.shape[0] for v in videos])
    x = torch.zeros(len(videos), int(lengths.max()), *videos[0].shape[1:])
    for k, v in enumerate(videos):
        x[k, :len(v)] = v
    return x, lengths, torch.cat(labels), torch.tensor([len(l) for l in labels])


class TConvBiLSTM(nn.Module):
    def __init__(self, num_classes, hidden=1024):
        super().__init__()
        r34 = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        r34.fc = nn.Identity()
        self.cnn = r34
        self.tconv = nn.Sequential(
            nn.Conv1d(512, hidden, 5, padding=0), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.MaxPool1d(2),
            nn.Conv1d(hidden, hidden, 5, padding=0), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.MaxPool1d(2))
        self.aux_cls = nn.Linear(hidden, num_classes)
        self.lstm = nn.LSTM(hidden, hidden // 2, 2, batch_first=True, bidirectional=True)
        self.cls = nn.Linear(hidden, num_classes)

    def forward(self, x, lengths):
        b, t = x.shape[:2]
        mask = torch.arange(t, device=x.device)[None] < lengths[:, None]
        frame_feats = self.cnn(x[mask])  # skip padded frames in the CNN
        feats = frame_feats.new_zeros(b, t, frame_feats.shape[-1])
        feats[mask] = frame_feats
        h = self.tconv(feats.transpose(1, 2)).transpose(1, 2)
        out_len = torch.div(torch.div(lengths - 4, 2, rounding_mode="floor") - 4, 2, rounding_mode="floor")
        packed = nn.utils.rnn.pack_padded_sequence(h, out_len.cpu(), batch_first=True, enforce_sorted=False)
        seq, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=h.shape[1])
        return self.cls(seq), self.aux_cls(h), out_len


def decode(logits, lengths, id2gloss):
    out = []
    for seq, n in zip(logits.argmax(-1).cpu(), lengths.cpu()):
        ids = [int(s) for s in torch.unique_consecutive(seq[:n]) if s != 0]
        out.append(" ".join(id2gloss[s] for s in ids))
    return out


@torch.no_grad()
def evaluate(model, loader, id2gloss, device):
    model.eval()
    hyps, refs = [], []
    for x, lengths, labels, label_lens in loader:
        logits, _, out_len = model(x.to(device, non_blocking=True), lengths.to(device))
        hyps += decode(logits, out_len, id2gloss)
        refs += [" ".join(id2gloss[int(g)] for g in r) for r in labels.split(label_lens.tolist())]
    hyps = [h if h else "<empty>" for h in hyps]
    return 100.0 * jiwer.wer(refs, hyps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5", default="/data/csl_daily/frames_{split}.h5")
    ap.add_argument("--ann-dir", default="/data/csl_daily/annotations")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--aux-weight", type=float, default=1.0)
    ap.add_argument("--out", default="exp/csl_daily_r34")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)

    with open(os.path.join(args.ann_dir, "gloss_vocab.txt"), encoding="utf-8") as f:
        id2gloss = ["<blank>"] + [l.strip() for l in f if l.strip()]
    gloss2id = {g: i for i, g in enumerate(id2gloss)}

    train_set = H5SignVideos(args.h5.format(split="train"), os.path.join(args.ann_dir, "train.txt"), gloss2id, True)
    dev_set = H5SignVideos(args.h5.format(split="dev"), os.path.join(args.ann_dir, "dev.txt"), gloss2id, False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    dev_sampler = DistributedSampler(dev_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=6, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_set, 1, sampler=dev_sampler, collate_fn=collate, num_workers=4, pin_memory=True)

    model = TConvBiLSTM(len(id2gloss))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world / 2, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [25, 35], 0.2)
    ctc = nn.CTCLoss(zero_infinity=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_wer = 100.0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for step, (x, lengths, labels, label_lens) in enumerate(train_loader):
            x, lengths = x.to(device, non_blocking=True), lengths.to(device)
            labels, label_lens = labels.to(device), label_lens.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux, out_len = model(x, lengths)
            loss = ctc(logits.float().log_softmax(-1).transpose(0, 1), labels, out_len, label_lens) \
                + args.aux_weight * ctc(aux.float().log_softmax(-1).transpose(0, 1), labels, out_len, label_lens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f}", flush=True)
        scheduler.step()

        wer = evaluate(model, dev_loader, id2gloss, device)
        if rank == 0:
            print(f"==> epoch {epoch} dev WER {wer:.2f}", flush=True)
            if wer < best_wer:
                best_wer = wer
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "wer": wer, "vocab": id2gloss},
                           os.path.join(args.out, "best.pt"))
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
