"""im2latex with a coverage-attention LSTM decoder (Tu et al. 2016 style coverage vector)
on top of a VGG-BN encoder with positional embeddings.

    torchrun --nproc_per_node=4 17_im2latex_coverage_attn.py --data data/im2latex_100k --epochs 15
"""
import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from nltk.translate.bleu_score import corpus_bleu

logger = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/im2latex_100k")
    ap.add_argument("--save_dir", default="checkpoints/coverage")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min_lr", type=float, default=3e-5)
    ap.add_argument("--emb_dim", type=int, default=80)
    ap.add_argument("--enc_dim", type=int, default=512)
    ap.add_argument("--dec_dim", type=int, default=512)
    ap.add_argument("--max_len", type=int, default=150)
    ap.add_argument("--cov_weight", type=float, default=0.5)
    return ap.parse_args()


class Vocab:
    def __init__(self, path):
        self.itos = ["<pad>", "<sos>", "<eos>", "<unk>"]
        with open(path, encoding="utf-8") as f:
            self.itos += [t.rstrip("\n") for t in f if t.rstrip("\n")]
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    def __len__(self):
        return len(self.itos)


class Im2LatexDataset(Dataset):
    def __init__(self, root, split, vocab, max_len):
        self.pairs = torch.load(os.path.join(root, f"{split}.pkl"))    # list of (png name, formula str)
        self.pairs = [(n, f) for n, f in self.pairs if len(f.split()) <= max_len - 2]
        self.root, self.vocab = root, vocab
        self.tf = transforms.Compose([transforms.Grayscale(), transforms.ToTensor()])

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        name, formula = self.pairs[i]
        x = self.tf(Image.open(os.path.join(self.root, "images", name)))
        ids = [1] + [self.vocab.stoi.get(t, 3) for t in formula.split()] + [2]
        return x, torch.tensor(ids)


def collate(batch):
    xs, ys = zip(*batch)
    H, W = max(x.shape[1] for x in xs), max(x.shape[2] for x in xs)
    img = torch.ones(len(xs), 1, H, W)
    for i, x in enumerate(xs):
        img[i, :, : x.shape[1], : x.shape[2]] = x
    return img, nn.utils.rnn.pad_sequence(ys, batch_first=True)


class VGGEncoder(nn.Module):
    def __init__(self, out_dim):
        super().__init__()
        cfg = [64, "M", 128, "M", 256, 256, "Mh", 512, "Mw", 512]
        layers, c = [], 1
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            elif v == "Mh":
                layers.append(nn.MaxPool2d((2, 1), (2, 1)))
            elif v == "Mw":
                layers.append(nn.MaxPool2d((1, 2), (1, 2)))
            else:
                layers += [nn.Conv2d(c, v, 3, 1, 1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(512, out_dim)
        self.row_emb = nn.Embedding(64, out_dim)
        self.col_emb = nn.Embedding(256, out_dim)

    def forward(self, x):
        f = self.features(x).permute(0, 2, 3, 1)
        B, H, W, _ = f.shape
        f = self.fc(f) + self.row_emb.weight[:H, None] + self.col_emb.weight[None, :W]
        return f.reshape(B, H * W, -1)


class CoverageDecoder(nn.Module):
    def __init__(self, vocab, emb, enc, dec):
        super().__init__()
        self.embedding = nn.Embedding(vocab, emb, padding_idx=0)
        self.lstm = nn.LSTMCell(emb + enc, dec)
        self.W_enc = nn.Linear(enc, dec, bias=False)
        self.W_dec = nn.Linear(dec, dec)
        self.W_cov = nn.Linear(1, dec, bias=False)
        self.v = nn.Linear(dec, 1, bias=False)
        self.init_h = nn.Linear(enc, dec)
        self.init_c = nn.Linear(enc, dec)
        self.out = nn.Linear(dec + enc, vocab)

    def forward(self, enc, tgt_in):
        B, N, _ = enc.shape
        mean = enc.mean(1)
        h, c = torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))
        ctx = torch.zeros_like(mean)
        cov = enc.new_zeros(B, N)
        enc_p = self.W_enc(enc)
        logits, cov_loss = [], 0.0
        for t in range(tgt_in.shape[1]):
            h, c = self.lstm(torch.cat([self.embedding(tgt_in[:, t]), ctx], -1), (h, c))
            e = self.v(torch.tanh(enc_p + self.W_dec(h)[:, None] + self.W_cov(cov[..., None]))).squeeze(-1)
            a = e.softmax(-1)
            cov_loss = cov_loss + torch.minimum(a, cov).sum(-1)
            cov = cov + a
            ctx = torch.bmm(a[:, None], enc).squeeze(1)
            logits.append(self.out(torch.cat([h, ctx], -1)))
        return torch.stack(logits, 1), cov_loss


class CoverageIm2Latex(nn.Module):
    def __init__(self, vocab, a):
        super().__init__()
        self.encoder = VGGEncoder(a.enc_dim)
        self.decoder = CoverageDecoder(vocab, a.emb_dim, a.enc_dim, a.dec_dim)

    def forward(self, img, tgt_in):
        return self.decoder(self.encoder(img), tgt_in)

    @torch.no_grad()
    def greedy(self, img, max_len):
        enc = self.encoder(img)
        tok = torch.full((img.shape[0], 1), 1, dtype=torch.long, device=img.device)
        seq = tok
        for _ in range(max_len - 1):
            logits, _ = self.decoder(enc, seq)     # re-runs the prefix; fine for validation sizes
            tok = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, tok], 1)
            if (seq == 2).any(1).all():
                break
        return seq


def clean(ids, itos):
    out = []
    for i in ids[1:]:
        if i == 2:
            break
        if i > 3:
            out.append(itos[i])
    return out


def evaluate(model, loader, vocab, max_len, device):
    model.eval()
    local = []
    for img, tgt in loader:
        pred = model.module.greedy(img.to(device), max_len)
        local += [(clean(p, vocab.itos), clean(t, vocab.itos)) for p, t in zip(pred.tolist(), tgt.tolist())]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    model.train()
    pairs = [x for g in gathered for x in g]
    bleu = corpus_bleu([[r] for _, r in pairs], [h for h, _ in pairs])
    return bleu, sum(h == r for h, r in pairs) / len(pairs)


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    vocab = Vocab(os.path.join(args.data, "vocab.txt"))
    train_set = Im2LatexDataset(args.data, "train", vocab, args.max_len)
    val_set = Im2LatexDataset(args.data, "validate", vocab, args.max_len)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size,
                            sampler=DistributedSampler(val_set, shuffle=False, drop_last=False),
                            num_workers=4, collate_fn=collate)

    model = CoverageIm2Latex(len(vocab), args)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader),
                                                           eta_min=args.min_lr)
    os.makedirs(args.save_dir, exist_ok=True)
    best_bleu = 0.0

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for it, (img, tgt) in enumerate(train_loader):
            img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits, cov_loss = model(img, tgt[:, :-1])
            nll = F.cross_entropy(logits.transpose(1, 2), tgt[:, 1:], ignore_index=0)
            loss = nll + args.cov_weight * cov_loss.mean() / tgt.shape[1]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if it % 100 == 0:
                logger.info("epoch %d it %d/%d nll %.4f cov %.4f lr %.2e", epoch, it, len(train_loader),
                            nll.item(), cov_loss.mean().item(), scheduler.get_last_lr()[0])

        bleu, em = evaluate(model, val_loader, vocab, args.max_len, device)
        logger.info("epoch %d done in %.0fs: BLEU %.4f exact %.4f", epoch, time.time() - t0, bleu, em)
        if rank == 0 and bleu > best_bleu:
            best_bleu = bleu
            torch.save({"model": model.module.state_dict(), "vocab": vocab.itos, "epoch": epoch},
                       os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
