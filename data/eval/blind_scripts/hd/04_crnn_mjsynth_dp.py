"""
CRNN scene-text recognizer trained on MJSynth + SynthText crops (LMDB, clovaai layout),
evaluated on IIIT5K / SVT / IC13.

Single node, all visible GPUs via DataParallel:
    CUDA_VISIBLE_DEVICES=0,1,2,3 python 04_crnn_mjsynth_dp.py \
        --train-lmdb /data/lmdb/training/MJ /data/lmdb/training/ST \
        --val-lmdb /data/lmdb/evaluation/IIIT5k_3000 --batch-size 768
"""
import argparse
import os
import string
import time

import lmdb
import numpy as np
import six
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import ConcatDataset, DataLoader, Dataset


def get_parser():
    p = argparse.ArgumentParser(description="CRNN / CTC")
    p.add_argument("--train-lmdb", nargs="+", required=True)
    p.add_argument("--val-lmdb", required=True)
    p.add_argument("--imgH", type=int, default=32)
    p.add_argument("--imgW", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=768)
    p.add_argument("--num-iter", type=int, default=300000)
    p.add_argument("--lr", type=float, default=1.0, help="Adadelta lr")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--max-len", type=int, default=25)
    p.add_argument("--val-interval", type=int, default=2000)
    p.add_argument("--save", default="saved_models/crnn_dp")
    return p


ALPHABET = string.digits + string.ascii_lowercase


class LmdbDataset(Dataset):
    def __init__(self, root, imgH, imgW, max_len):
        self.root, self.imgH, self.imgW, self.max_len = root, imgH, imgW, max_len
        env = lmdb.open(root, max_readers=32, readonly=True, lock=False, readahead=False, meminit=False)
        with env.begin(write=False) as txn:
            self.n = int(txn.get(b"num-samples"))
        env.close()
        self.env = None

    def _open(self):
        self.env = lmdb.open(self.root, max_readers=32, readonly=True, lock=False, readahead=False, meminit=False)

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if self.env is None:
            self._open()
        index += 1  # lmdb keys are 1-based
        with self.env.begin(write=False) as txn:
            label = txn.get(b"label-%09d" % index).decode("utf-8").lower()
            buf = six.BytesIO(txn.get(b"image-%09d" % index))
        img = Image.open(buf).convert("L").resize((self.imgW, self.imgH), Image.BICUBIC)
        label = "".join(c for c in label if c in ALPHABET)[: self.max_len]
        img = torch.from_numpy(np.asarray(img, dtype=np.float32)).unsqueeze(0).sub_(127.5).div_(127.5)
        return img, label


class LabelConverter:
    def __init__(self, alphabet, max_len):
        self.dict = {c: i + 1 for i, c in enumerate(alphabet)}
        self.alphabet = alphabet
        self.max_len = max_len

    def encode(self, texts):
        lengths = torch.tensor([len(t) for t in texts], dtype=torch.long)
        padded = torch.zeros(len(texts), self.max_len, dtype=torch.long)
        for i, t in enumerate(texts):
            padded[i, : len(t)] = torch.tensor([self.dict[c] for c in t], dtype=torch.long)
        return padded, lengths

    def decode(self, idx):
        res = []
        for seq in idx.tolist():
            chars, prev = [], 0
            for k in seq:
                if k != 0 and k != prev:
                    chars.append(self.alphabet[k - 1])
                prev = k
            res.append("".join(chars))
        return res


class BidirectionalLSTM(nn.Module):
    def __init__(self, nin, nhidden, nout):
        super().__init__()
        self.rnn = nn.LSTM(nin, nhidden, bidirectional=True)
        self.embedding = nn.Linear(nhidden * 2, nout)

    def forward(self, x):
        self.rnn.flatten_parameters()
        rec, _ = self.rnn(x)
        T, b, h = rec.size()
        return self.embedding(rec.view(T * b, h)).view(T, b, -1)


class CRNN(nn.Module):
    def __init__(self, nclass, nh=256):
        super().__init__()
        ks, ps, ss = [3, 3, 3, 3, 3, 3, 2], [1, 1, 1, 1, 1, 1, 0], [1] * 7
        nm = [64, 128, 256, 256, 512, 512, 512]
        cnn = nn.Sequential()

        def conv(i, bn=False):
            nin = 1 if i == 0 else nm[i - 1]
            cnn.add_module(f"conv{i}", nn.Conv2d(nin, nm[i], ks[i], ss[i], ps[i]))
            if bn:
                cnn.add_module(f"bn{i}", nn.BatchNorm2d(nm[i]))
            cnn.add_module(f"relu{i}", nn.ReLU(True))

        conv(0); cnn.add_module("pool0", nn.MaxPool2d(2, 2))
        conv(1); cnn.add_module("pool1", nn.MaxPool2d(2, 2))
        conv(2, True); conv(3); cnn.add_module("pool2", nn.MaxPool2d((2, 2), (2, 1), (0, 1)))
        conv(4, True); conv(5); cnn.add_module("pool3", nn.MaxPool2d((2, 2), (2, 1), (0, 1)))
        conv(6, True)
        self.cnn = cnn
        self.rnn = nn.Sequential(BidirectionalLSTM(512, nh, nh), BidirectionalLSTM(nh, nh, nclass))

    def forward(self, x):
        conv = self.cnn(x)
        conv = conv.squeeze(2).permute(2, 0, 1)  # T, B, C
        return self.rnn(conv)


class CRNNWithCTC(nn.Module):
    """Keeps the loss next to the model so train and eval share one forward."""

    def __init__(self, nclass):
        super().__init__()
        self.crnn = CRNN(nclass)
        self.ctc = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)

    def forward(self, images, targets=None, target_lengths=None):
        logits = self.crnn(images)  # T, B, C
        if targets is None:
            return logits.transpose(0, 1)  # B, T, C
        log_probs = F.log_softmax(logits, 2)
        T, B, _ = log_probs.shape
        input_lengths = torch.full((B,), T, dtype=torch.long, device=log_probs.device)
        return self.ctc(log_probs, targets, input_lengths, target_lengths)


def collate(batch):
    imgs, labels = zip(*batch)
    return torch.stack(imgs), list(labels)


def weights_init(m):
    name = m.__class__.__name__
    if name.find("Conv") != -1:
        nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    elif name.find("BatchNorm") != -1:
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


@torch.no_grad()
def validate(model, loader, converter):
    model.eval()
    correct = total = 0
    for images, labels in loader:
        logits = model(images.cuda())
        preds = converter.decode(logits.argmax(2).cpu())
        for p, gt in zip(preds, labels):
            correct += int(p == gt)
            total += 1
    model.train()
    return correct / max(total, 1)


def main():
    opt = get_parser().parse_args()
    os.makedirs(opt.save, exist_ok=True)
    torch.backends.cudnn.benchmark = True
    n_gpu = torch.cuda.device_count()
    print(f"using {n_gpu} GPUs, global batch {opt.batch_size}")

    converter = LabelConverter(ALPHABET, opt.max_len)
    train_set = ConcatDataset([LmdbDataset(r, opt.imgH, opt.imgW, opt.max_len) for r in opt.train_lmdb])
    val_set = LmdbDataset(opt.val_lmdb, opt.imgH, opt.imgW, opt.max_len)
    train_loader = DataLoader(train_set, batch_size=opt.batch_size, shuffle=True, num_workers=opt.workers,
                              pin_memory=True, drop_last=True, collate_fn=collate, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=256, shuffle=False, num_workers=4, collate_fn=collate)

    model = CRNNWithCTC(len(ALPHABET) + 1)
    model.apply(weights_init)
    model = nn.DataParallel(model).cuda()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=opt.lr, rho=0.95, eps=1e-8)

    best_acc, it, t0 = 0.0, 0, time.time()
    model.train()
    while it < opt.num_iter:
        for images, labels in train_loader:
            images = images.cuda(non_blocking=True)
            targets, target_lengths = converter.encode(labels)
            loss = model(images, targets.cuda(), target_lengths.cuda())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5)
            optimizer.step()
            it += 1

            if it % 100 == 0:
                print(f"[{it}/{opt.num_iter}] loss {loss.item():.4f} {time.time() - t0:.1f}s", flush=True)
            if it % opt.val_interval == 0:
                acc = validate(model, val_loader, converter)
                print(f"[{it}] val word acc {acc:.4f}", flush=True)
                torch.save(model.module.state_dict(), os.path.join(opt.save, "last.pth"))
                if acc > best_acc:
                    best_acc = acc
                    torch.save(model.module.state_dict(), os.path.join(opt.save, "best_accuracy.pth"))
            if it >= opt.num_iter:
                break
    print(f"done, best acc {best_acc:.4f}")


if __name__ == "__main__":
    main()
