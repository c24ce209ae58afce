"""Lip reading fine-tuning on raw talking-face videos with on-the-fly mouth cropping.

For small in-domain sets (a few thousand clips) we skip the offline ROI extraction: each clip is
decoded, landmarks are detected with face_alignment (SFD detector + FAN), and the mouth ROI is cropped
inside the Dataset. The visual encoder is initialised from an LRS3 VSR checkpoint.

    torchrun --nproc_per_node=4 15_vsr_online_face_detect.py --train-csv data/clinic/train.csv \
        --valid-csv data/clinic/valid.csv --init ckpt/lrs3_vsr_base.pt
"""
import argparse
import csv
import math
import os

import cv2
import editdistance
import face_alignment
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

MEAN, STD = 0.421, 0.165


class RawVideoLips(Dataset):
    def __init__(self, csv_path, sp, device, train, roi=96):
        with open(csv_path) as f:
            self.rows = list(csv.DictReader(f))
        self.sp, self.device, self.train, self.roi = sp, device, train, roi
        self._fa = None

    @property
    def fa(self):
        if self._fa is None:
            self._fa = face_alignment.FaceAlignment(face_alignment.LandmarksType.TWO_D, flip_input=False,
                                                    device=self.device, face_detector="sfd")
        return self._fa

    def __len__(self):
        return len(self.rows)

    def crop(self, frames):
        lms = self.fa.get_landmarks_from_batch(torch.from_numpy(frames).permute(0, 3, 1, 2).float())
        centres, last = [], None
        for lm in lms:
            if lm is not None and len(lm) >= 68:
                last = lm[:68][48:68].mean(0)
            centres.append(last)
        first = next((c for c in centres if c is not None), np.array([frames.shape[2] / 2, frames.shape[1] * 0.7]))
        centres = [first if c is None else c for c in centres]
        half = self.roi // 2
        out = []
        for img, (cx, cy) in zip(frames, centres):
            g = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY)
            g = cv2.copyMakeBorder(g, half, half, half, half, cv2.BORDER_REPLICATE)
            out.append(g[int(cy):int(cy) + self.roi, int(cx):int(cx) + self.roi])
        return np.stack(out)

    def __getitem__(self, i):
        row = self.rows[i]
        frames, _, info = torchvision.io.read_video(row["path"], pts_unit="sec", output_format="THWC")
        frames = frames.numpy()
        if abs(info.get("video_fps", 25.0) - 25.0) > 0.5:
            idx = np.linspace(0, len(frames) - 1, int(round(len(frames) * 25.0 / info["video_fps"]))).astype(int)
            frames = frames[idx]
        rois = self.crop(frames).astype(np.float32) / 255.0
        if self.train:
            y, x = np.random.randint(0, 9, 2)
            rois = rois[:, y:y + 88, x:x + 88]
            if np.random.rand() < 0.5:
                rois = rois[:, :, ::-1]
        else:
            rois = rois[:, 4:92, 4:92]
        rois = (np.ascontiguousarray(rois) - MEAN) / STD
        return torch.from_numpy(rois), torch.tensor(self.sp.encode(row["text"].lower())) + 1, row["text"].lower()


def collate(b):
    v, y, t = zip(*b)
    return (nn.utils.rnn.pad_sequence(v, True), torch.tensor([len(x) for x in v]), nn.utils.rnn.pad_sequence(y, True),
            torch.tensor([len(x) for x in y]), t)


class VSREncoder(nn.Module):
    def __init__(self, d=512, layers=12):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False), nn.BatchNorm3d(64),
                                  nn.ReLU(True), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        r18 = torchvision.models.resnet18(weights=None)
        self.trunk = nn.Sequential(r18.layer1, r18.layer2, r18.layer3, r18.layer4, nn.AdaptiveAvgPool2d(1))
        self.proj = nn.Linear(512, d)
        self.pos = nn.Parameter(torch.zeros(1, 1500, d))
        self.tf = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 2048, 0.1, batch_first=True, norm_first=True),
                                        layers)

    def forward(self, v, lens):
        b, t = v.shape[:2]
        x = self.stem(v.unsqueeze(1)).transpose(1, 2).flatten(0, 1)
        x = self.proj(self.trunk(x).flatten(1)).view(b, t, -1) + self.pos[:, :t]
        pad = torch.arange(t, device=v.device)[None] >= lens[:, None]
        return self.tf(x, src_key_padding_mask=pad), pad


class VSR(nn.Module):
    def __init__(self, vocab, d=512):
        super().__init__()
        self.encoder = VSREncoder(d)
        self.ctc_head = nn.Linear(d, vocab)
        self.embed = nn.Embedding(vocab, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True,
                                                                        norm_first=True), 6)
        self.att_head = nn.Linear(d, vocab)
        self.eos = vocab - 1

    def forward(self, v, lens, y, ylens, w=0.1):
        mem, pad = self.encoder(v, lens)
        l_ctc = F.ctc_loss(self.ctc_head(mem).float().log_softmax(-1).transpose(0, 1), y, lens, ylens, zero_infinity=True)
        yi = F.pad(y, (1, 0), value=self.eos)
        yo = F.pad(y, (0, 1))
        yo[torch.arange(len(y)), ylens] = self.eos
        yo = yo.masked_fill(torch.arange(yo.size(1), device=y.device)[None] > ylens[:, None], -100)
        L = yi.size(1)
        h = self.decoder(self.embed(yi) + self.encoder.pos[:, :L], mem, memory_key_padding_mask=pad,
                         tgt_mask=nn.Transformer.generate_square_subsequent_mask(L, device=y.device))
        l_att = F.cross_entropy(self.att_head(h).float().transpose(1, 2), yo, ignore_index=-100, label_smoothing=0.1)
        return w * l_ctc + (1 - w) * l_att


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--valid-csv", required=True)
    ap.add_argument("--spm", default="ckpt/spm_unigram1000.model")
    ap.add_argument("--init", default=None)
    ap.add_argument("--out", default="exp/clinic_vsr_ft")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    V = sp.get_piece_size() + 2
    train_ds = RawVideoLips(args.train_csv, sp, f"cuda:{local_rank}", train=True)
    valid_ds = RawVideoLips(args.valid_csv, sp, f"cuda:{local_rank}", train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                          drop_last=True, pin_memory=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), args.bs, num_workers=args.workers,
                          collate_fn=collate)

    model = VSR(V)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")["model"]
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print(f"loaded {args.init}: {len(missing)} missing, {len(unexpected)} unexpected keys")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW([
        {"params": model.module.encoder.parameters(), "lr": args.lr * 0.3},
        {"params": [p for n, p in model.module.named_parameters() if not n.startswith("encoder.")], "lr": args.lr},
    ], weight_decay=0.01)
    steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (v, lens, y, ylens, _) in enumerate(train_dl):
            v, lens, y, ylens = v.to(device), lens.to(device), y.to(device), ylens.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(v, lens, y, ylens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 20 == 0:
                print(f"epoch {epoch} it {it}/{len(train_dl)} loss {loss.item():.3f}", flush=True)

        net = model.module.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for v, lens, _, _, texts in valid_dl:
                mem, _ = net.encoder(v.to(device), lens.to(device))
                for row, n, ref in zip(net.ctc_head(mem).argmax(-1), lens.tolist(), texts):
                    ids = [t - 1 for t in torch.unique_consecutive(row[:n]).tolist() if 0 < t < V - 1]
                    stats[0] += editdistance.eval(sp.decode(ids).split(), ref.split())
                    stats[1] += len(ref.split())
        dist.all_reduce(stats)
        net.train()
        wer = (stats[0] / stats[1]).item()
        if rank == 0:
            print(f"epoch {epoch} valid WER {100 * wer:.2f}%", flush=True)
            state = {"model": net.state_dict(), "epoch": epoch, "wer": wer}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if wer < best:
                best = wer
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
