"""BiT-R50 (GroupNorm) visual extractor + Transformer decoder, R2Gen-style word vocabulary.

Validation decodes with beam search on every rank; token ids are gathered as
tensors (faster than pickling strings) and scored on rank 0.

    torchrun --nproc_per_node=8 14_bit_r2gen_beam.py --dataset mimic_cxr
"""
import argparse
import json
import os
import re
from collections import Counter

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

PAD, BOS, EOS, UNK = 0, 1, 2, 3
DATASETS = {"mimic_cxr": ("data/mimic_cxr/annotation.json", "data/mimic_cxr/images"),
            "iu_xray": ("data/iu_xray/annotation.json", "data/iu_xray/images")}


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", choices=list(DATASETS), default="mimic_cxr")
    p.add_argument("--save-dir", default="results/bit_r2gen")
    p.add_argument("--threshold", type=int, default=10)
    p.add_argument("--max-seq-length", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr-ve", type=float, default=5e-5)
    p.add_argument("--lr-ed", type=float, default=1e-4)
    p.add_argument("--beam-size", type=int, default=3)
    return p.parse_args()


def clean(text):
    text = re.sub(r"[.,?;*!%^&_+():\-\[\]{}]", "", text.replace("\n", " ").lower())
    return " ".join(text.split())


class WordTokenizer:
    def __init__(self, train_reports, threshold):
        counter = Counter(w for r in train_reports for w in clean(r).split())
        self.vocab = ["<pad>", "<bos>", "<eos>", "<unk>"] + sorted(w for w, c in counter.items() if c >= threshold)
        self.idx = {w: i for i, w in enumerate(self.vocab)}

    def encode(self, text, max_len):
        return [BOS] + [self.idx.get(w, UNK) for w in clean(text).split()][: max_len - 2] + [EOS]

    def decode(self, ids):
        words = []
        for t in ids:
            if t == EOS:
                break
            if t > UNK:
                words.append(self.vocab[t])
        return " ".join(words)


class AnnDataset(Dataset):
    def __init__(self, items, root, tokenizer, max_len, train):
        self.items, self.root = items, root
        self.ids = [tokenizer.encode(it["report"], max_len) for it in items]
        self.tf = transforms.Compose([
            transforms.Resize(256), transforms.RandomCrop(224) if train else transforms.CenterCrop(224),
            *([transforms.RandomHorizontalFlip()] if train else []),
            transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img = self.tf(Image.open(os.path.join(self.root, self.items[i]["image_path"][0])).convert("RGB"))
        return img, torch.tensor(self.ids[i]), i


def collate(batch):
    imgs, seqs, idx = zip(*batch)
    return torch.stack(imgs), pad_sequence(seqs, batch_first=True, padding_value=PAD), torch.tensor(idx)


class BiTReportGen(nn.Module):
    def __init__(self, vocab_size, d=512, n_layers=3, max_len=100):
        super().__init__()
        self.ve = timm.create_model("resnetv2_50x1_bit.goog_in21k", pretrained=True, num_classes=0)
        self.proj = nn.Linear(self.ve.num_features, d)
        self.emb = nn.Embedding(vocab_size, d, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d)
        self.ed = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True), n_layers)
        self.logit = nn.Linear(d, vocab_size)

    def encode(self, img):
        return self.proj(self.ve.forward_features(img).flatten(2).transpose(1, 2))

    def decode(self, seq, mem):
        L = seq.size(1)
        x = self.emb(seq) + self.pos(torch.arange(L, device=seq.device))
        m = nn.Transformer.generate_square_subsequent_mask(L, device=seq.device)
        return self.logit(self.ed(x, mem, tgt_mask=m, tgt_key_padding_mask=seq == PAD))

    def forward(self, img, seq):
        return self.decode(seq, self.encode(img))

    @torch.no_grad()
    def beam_search(self, img, beam, max_len):
        mem = self.encode(img)
        B, dev = img.size(0), img.device
        mem = mem.repeat_interleave(beam, 0)
        seq = torch.full((B * beam, 1), BOS, dtype=torch.long, device=dev)
        score = torch.full((B, beam), -1e9, device=dev)
        score[:, 0] = 0
        score = score.flatten()
        done = torch.zeros_like(score, dtype=torch.bool)
        offset = torch.arange(B, device=dev)[:, None] * beam
        for _ in range(max_len - 1):
            lp = self.decode(seq, mem)[:, -1].float().log_softmax(-1)
            lp[done] = -1e9
            lp[done, EOS] = 0
            V = lp.size(1)
            s, k = (score[:, None] + lp).view(B, -1).topk(beam, 1)
            src = (offset + k // V).flatten()
            tok = (k % V).flatten()
            seq = torch.cat([seq[src], tok[:, None]], 1)
            done = done[src] | (tok == EOS)
            score = s.flatten()
            if done.all():
                break
        best = score.view(B, beam).argmax(1)
        return seq.view(B, beam, -1)[torch.arange(B, device=dev), best]


def validate(model, loader, tokenizer, refs, args, device, rank, world):
    net = model.module
    net.eval()
    seqs, order = [], []
    for img, _, idx in loader:
        out = net.beam_search(img.to(device, non_blocking=True), args.beam_size, args.max_seq_length)
        seqs.extend(out.unbind(0))
        order.append(idx.to(device))
    net.train()
    preds = pad_sequence(seqs, batch_first=True, padding_value=PAD)
    order = torch.cat(order)
    all_preds = [torch.empty_like(preds) for _ in range(world)]
    all_order = [torch.empty_like(order) for _ in range(world)]
    dist.all_gather(all_preds, preds)
    dist.all_gather(all_order, order)
    if rank != 0:
        return None
    res = {}
    for p, o in zip(all_preds, all_order):
        for ids, i in zip(p.tolist(), o.tolist()):
            res[i] = [tokenizer.decode(ids[1:]) or "."]
    gts = {i: [clean(refs[i])] for i in res}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    cider, _ = Cider().compute_score(gts, res)
    return {"BLEU_1": bleu[0], "BLEU_4": bleu[3], "CIDEr": cider}


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    ann_path, image_dir = DATASETS[args.dataset]
    with open(ann_path) as f:
        ann = json.load(f)
    tokenizer = WordTokenizer([x["report"] for x in ann["train"]], args.threshold)
    train_ds = AnnDataset(ann["train"], image_dir, tokenizer, args.max_seq_length, True)
    val_ds = AnnDataset(ann["val"], image_dir, tokenizer, args.max_seq_length, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=collate, num_workers=6, pin_memory=True)

    model = BiTReportGen(len(tokenizer.vocab), max_len=args.max_seq_length).to(device)
    model = DDP(model, device_ids=[local_rank])
    ve = list(model.module.ve.parameters())
    ve_ids = {id(p) for p in ve}
    optimizer = torch.optim.Adam([{"params": ve, "lr": args.lr_ve},
                                  {"params": [p for p in model.parameters() if id(p) not in ve_ids],
                                   "lr": args.lr_ed}], weight_decay=5e-5, amsgrad=True)
    lr_sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.8)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"vocab size {len(tokenizer.vocab)}, {len(train_ds)} train, {len(val_ds)} val")
    best = -1.0
    refs = [x["report"] for x in ann["val"]]
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for img, seq, _ in train_dl:
            img, seq = img.to(device, non_blocking=True), seq.to(device, non_blocking=True)
            logits = model(img, seq[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), seq[:, 1:].reshape(-1), ignore_index=PAD)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_value_(model.parameters(), 0.1)
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones_like(loss)])
        lr_sched.step()
        dist.all_reduce(total)

        scores = validate(model, val_dl, tokenizer, refs, args, device, rank, world)
        if rank == 0:
            print(json.dumps({"epoch": epoch, "train_loss": (total[0] / total[1]).item(), **scores}), flush=True)
            if scores["BLEU_4"] > best:
                best = scores["BLEU_4"]
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                            "vocab": tokenizer.vocab, "scores": scores},
                           os.path.join(args.save_dir, "model_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
