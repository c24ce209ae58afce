"""CRNN + CTC text-line recogniser for scanned invoices (line crops produced by our detector).

    torchrun --standalone --nproc_per_node=4 05_ocr_crnn_ctc.py --config configs/crnn_invoice.yaml
"""
import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List

import editdistance
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

logger = logging.getLogger("crnn")


@dataclass
class OCRConfig:
    train_manifest: str = "data/lines/train.tsv"
    val_manifest: str = "data/lines/val.tsv"
    charset_file: str = "data/lines/charset.txt"
    img_height: int = 32
    max_width: int = 512
    batch_size: int = 64
    lr: float = 5e-4
    epochs: int = 50
    hidden: int = 256
    save_dir: str = "checkpoints/crnn"
    workers: int = 6


class LineDataset(Dataset):
    def __init__(self, manifest: str, charset: str, height: int, max_width: int, train: bool):
        rows = [l.rstrip("\n").split("\t") for l in open(manifest, encoding="utf-8")]
        self.items = [(p, t) for p, t in rows if 0 < len(t) <= max_width // 4]
        self.char_to_idx = {c: i + 1 for i, c in enumerate(charset)}  # 0 = CTC blank
        self.height, self.max_width = height, max_width
        aug = [transforms.ColorJitter(0.3, 0.3), transforms.RandomAffine(2, shear=3, fill=255)] if train else []
        self.tf = transforms.Compose(aug + [transforms.Grayscale(), transforms.ToTensor(),
                                            transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, text = self.items[i]
        img = Image.open(path).convert("RGB")
        w = min(self.max_width, max(16, int(img.width * self.height / img.height)))
        img = self.tf(img.resize((w, self.height), Image.BILINEAR))
        target = torch.tensor([self.char_to_idx.get(c, 0) for c in text], dtype=torch.long)
        return img, target, text


def collate(batch):
    imgs, targets, texts = zip(*batch)
    max_w = max(im.shape[-1] for im in imgs)
    padded = torch.ones(len(imgs), 1, imgs[0].shape[1], max_w)
    for i, im in enumerate(imgs):
        padded[i, :, :, : im.shape[-1]] = im
    lengths = torch.tensor([len(t) for t in targets])
    return padded, torch.cat(targets), lengths, list(texts)


class CRNN(nn.Module):
    def __init__(self, num_classes: int, hidden: int, charset: str):
        super().__init__()
        self.charset = charset

        def block(cin, cout, pool):
            return [nn.Conv2d(cin, cout, 3, 1, 1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True), nn.MaxPool2d(pool)]

        self.cnn = nn.Sequential(*block(1, 64, (2, 2)), *block(64, 128, (2, 2)), *block(128, 256, (2, 1)),
                                 *block(256, 256, (2, 1)), *block(256, 512, (2, 1)))
        self.rnn = nn.LSTM(512, hidden, num_layers=2, bidirectional=True, batch_first=True, dropout=0.1)
        self.fc = nn.Linear(2 * hidden, num_classes)

    def forward(self, x):
        f = self.cnn(x).squeeze(2).permute(0, 2, 1)  # B, T, C
        out, _ = self.rnn(f)
        return self.fc(out).log_softmax(-1)

    def decode(self, log_probs) -> List[str]:
        best = log_probs.argmax(-1).cpu().tolist()
        texts = []
        for seq in best:
            chars, prev = [], 0
            for idx in seq:
                if idx != prev and idx != 0:
                    chars.append(self.charset[idx - 1])
                prev = idx
            texts.append("".join(chars))
        return texts


class Trainer:
    def __init__(self, cfg: OCRConfig, local_rank: int):
        self.cfg = cfg
        self.device = torch.device("cuda", local_rank)
        self.is_main = dist.get_rank() == 0
        charset = Path(cfg.charset_file).read_text(encoding="utf-8").rstrip("\n")
        train_ds = LineDataset(cfg.train_manifest, charset, cfg.img_height, cfg.max_width, train=True)
        val_ds = LineDataset(cfg.val_manifest, charset, cfg.img_height, cfg.max_width, train=False)
        self.train_sampler = DistributedSampler(train_ds)
        self.train_loader = DataLoader(train_ds, cfg.batch_size, sampler=self.train_sampler, collate_fn=collate,
                                       num_workers=cfg.workers, pin_memory=True, drop_last=True)
        self.val_loader = DataLoader(val_ds, cfg.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                                     collate_fn=collate, num_workers=cfg.workers)
        net = CRNN(len(charset) + 1, cfg.hidden, charset).to(self.device)
        self.model = DDP(net, device_ids=[local_rank])
        self.ctc = nn.CTCLoss(blank=0, zero_infinity=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(self.opt, factor=0.5, patience=3)
        self.best_cer = float("inf")

    def train_epoch(self, epoch: int):
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        total = torch.zeros(2, device=self.device)
        for imgs, targets, lengths, _ in self.train_loader:
            imgs = imgs.to(self.device, non_blocking=True)
            log_probs = self.model(imgs)
            input_lengths = torch.full((imgs.size(0),), log_probs.size(1), dtype=torch.long)
            loss = self.ctc(log_probs.permute(1, 0, 2).float(), targets, input_lengths, lengths)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            self.opt.step()
            total += torch.tensor([loss.item(), 1.0], device=self.device)
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        errs = torch.zeros(2, device=self.device, dtype=torch.float64)  # edit distance, ref chars
        for imgs, _, _, texts in self.val_loader:
            log_probs = self.model(imgs.to(self.device, non_blocking=True))
            preds = self.model.decode(log_probs)
            for p, t in zip(preds, texts):
                errs[0] += editdistance.eval(p, t)
                errs[1] += len(t)
        dist.all_reduce(errs)
        return (errs[0] / errs[1]).item()

    def save(self, epoch: int, cer: float):
        if not self.is_main:
            return
        os.makedirs(self.cfg.save_dir, exist_ok=True)
        state = {"model": self.model.module.state_dict(), "charset": self.model.module.charset,
                 "epoch": epoch, "cer": cer}
        torch.save(state, os.path.join(self.cfg.save_dir, "last.pt"))
        if cer < self.best_cer:
            self.best_cer = cer
            torch.save(state, os.path.join(self.cfg.save_dir, "best.pt"))

    def fit(self):
        for epoch in range(self.cfg.epochs):
            loss = self.train_epoch(epoch)
            cer = self.validate()
            self.sched.step(cer)
            if self.is_main:
                logger.info("epoch %03d loss %.4f val_cer %.4f lr %.2e", epoch, loss, cer,
                            self.opt.param_groups[0]["lr"])
            self.save(epoch, cer)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/crnn_invoice.yaml")
    cfg = OCRConfig(**yaml.safe_load(open(ap.parse_args().config)))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    logging.basicConfig(level=logging.INFO if dist.get_rank() == 0 else logging.WARNING)
    try:
        Trainer(cfg, local_rank).fit()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
