"""Show, Attend and Tell on COCO (Karpathy split), multi-GPU.

Images/captions come from the usual create_input_files() HDF5 + JSON dumps.
The ResNet-101 encoder is frozen; only the attention LSTM decoder is trained.

    torchrun --nproc_per_node=4 05_show_attend_tell_ddp.py --data_folder /data/coco_sat
"""
import argparse
import json
import os
import time

import h5py
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider

device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
DATA_NAME = "coco_5_cap_per_img_5_min_word_freq"


class CaptionDataset(Dataset):
    def __init__(self, data_folder, split):
        self.split = split
        self.h5_path = os.path.join(data_folder, f"{split}_IMAGES_{DATA_NAME}.hdf5")
        self.h5 = None
        with h5py.File(self.h5_path, "r") as h:
            self.cpi = h.attrs["captions_per_image"]
            self.n_images = len(h["images"])
        with open(os.path.join(data_folder, f"{split}_CAPTIONS_{DATA_NAME}.json")) as f:
            self.captions = json.load(f)
        with open(os.path.join(data_folder, f"{split}_CAPLENS_{DATA_NAME}.json")) as f:
            self.caplens = json.load(f)
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __len__(self):
        # one item per caption for training, one per image for evaluation
        return len(self.captions) if self.split == "TRAIN" else self.n_images

    def _image(self, i):
        if self.h5 is None:  # open lazily inside each worker
            self.h5 = h5py.File(self.h5_path, "r")
        img = torch.from_numpy(self.h5["images"][i]).float() / 255.0
        return (img - self.mean) / self.std

    def __getitem__(self, i):
        if self.split == "TRAIN":
            return self._image(i // self.cpi), torch.LongTensor(self.captions[i]), torch.LongTensor([self.caplens[i]])
        caps = self.captions[i * self.cpi:(i + 1) * self.cpi]
        return self._image(i), torch.LongTensor(caps), i


class Encoder(nn.Module):
    def __init__(self, size=14):
        super().__init__()
        resnet = torchvision.models.resnet101(weights="IMAGENET1K_V1")
        self.resnet = nn.Sequential(*list(resnet.children())[:-2])
        self.pool = nn.AdaptiveAvgPool2d((size, size))

    def forward(self, images):
        out = self.pool(self.resnet(images))
        return out.permute(0, 2, 3, 1)


class Attention(nn.Module):
    def __init__(self, enc_dim, dec_dim, att_dim):
        super().__init__()
        self.enc_att = nn.Linear(enc_dim, att_dim)
        self.dec_att = nn.Linear(dec_dim, att_dim)
        self.full_att = nn.Linear(att_dim, 1)

    def forward(self, enc, h):
        att = self.full_att(torch.relu(self.enc_att(enc) + self.dec_att(h).unsqueeze(1))).squeeze(2)
        alpha = att.softmax(dim=1)
        return (enc * alpha.unsqueeze(2)).sum(dim=1), alpha


class DecoderWithAttention(nn.Module):
    def __init__(self, att_dim, emb_dim, dec_dim, vocab_size, enc_dim=2048, dropout=0.5):
        super().__init__()
        self.vocab_size = vocab_size
        self.attention = Attention(enc_dim, dec_dim, att_dim)
        self.embedding = nn.Embedding(vocab_size, emb_dim)
        self.dropout = nn.Dropout(dropout)
        self.decode_step = nn.LSTMCell(emb_dim + enc_dim, dec_dim)
        self.init_h = nn.Linear(enc_dim, dec_dim)
        self.init_c = nn.Linear(enc_dim, dec_dim)
        self.f_beta = nn.Linear(dec_dim, enc_dim)
        self.fc = nn.Linear(dec_dim, vocab_size)

    def init_hidden_state(self, enc):
        mean = enc.mean(dim=1)
        return self.init_h(mean), self.init_c(mean)

    def step(self, enc, words, h, c):
        awe, alpha = self.attention(enc, h)
        awe = torch.sigmoid(self.f_beta(h)) * awe
        h, c = self.decode_step(torch.cat([self.embedding(words), awe], dim=1), (h, c))
        return self.fc(self.dropout(h)), h, c, alpha

    def forward(self, enc, caps, caplens):
        B = enc.size(0)
        enc = enc.view(B, -1, enc.size(-1))
        caplens, order = caplens.squeeze(1).sort(dim=0, descending=True)
        enc, caps = enc[order], caps[order]
        h, c = self.init_hidden_state(enc)
        dec_lens = (caplens - 1).tolist()
        T = max(dec_lens)
        predictions = torch.zeros(B, T, self.vocab_size).to(device)
        alphas = torch.zeros(B, T, enc.size(1)).to(device)
        for t in range(T):
            bt = sum(l > t for l in dec_lens)
            preds, h_t, c_t, alpha = self.step(enc[:bt], caps[:bt, t], h[:bt], c[:bt])
            h, c = h_t, c_t
            predictions[:bt, t] = preds
            alphas[:bt, t] = alpha
        return predictions, caps, dec_lens, alphas


@torch.no_grad()
def beam_search(encoder, decoder, image, word_map, beam_size=3, max_steps=50):
    k = beam_size
    enc = encoder(image.unsqueeze(0))
    enc = enc.view(1, -1, enc.size(-1)).expand(k, -1, -1)
    prev = torch.full((k,), word_map["<start>"], dtype=torch.long, device=enc.device)
    seqs = prev.unsqueeze(1)
    top_scores = torch.zeros(k, 1, device=enc.device)
    done_seqs, done_scores = [], []
    h, c = decoder.init_hidden_state(enc)
    for step in range(1, max_steps + 1):
        logits, h, c, _ = decoder.step(enc, prev, h, c)
        scores = top_scores.expand_as(logits) + F.log_softmax(logits, dim=1)
        flat = scores[0] if step == 1 else scores.view(-1)
        top_scores, top_words = flat.topk(k, 0)
        prev_idx = torch.div(top_words, decoder.vocab_size, rounding_mode="floor")
        next_words = top_words % decoder.vocab_size
        seqs = torch.cat([seqs[prev_idx], next_words.unsqueeze(1)], dim=1)
        incomplete = next_words != word_map["<end>"]
        for i in (~incomplete).nonzero().flatten().tolist():
            done_seqs.append(seqs[i].tolist())
            done_scores.append(top_scores[i].item())
        k -= int((~incomplete).sum())
        if k == 0:
            break
        seqs, enc = seqs[incomplete], enc[prev_idx[incomplete]]
        h, c = h[prev_idx[incomplete]], c[prev_idx[incomplete]]
        top_scores = top_scores[incomplete].unsqueeze(1)
        prev = next_words[incomplete]
    if not done_seqs:
        done_seqs, done_scores = [s.tolist() for s in seqs], top_scores.squeeze(1).tolist()
    return done_seqs[max(range(len(done_scores)), key=done_scores.__getitem__)]


def to_words(seq, rev_map, word_map):
    skip = {word_map["<start>"], word_map["<end>"], word_map["<pad>"]}
    return " ".join(rev_map[w] for w in seq if w not in skip)


def evaluate(encoder, decoder, loader, word_map, rev_map, beam_size, dev):
    decoder.eval()
    local = []
    for images, caps, idx in loader:
        images = images.to(dev, non_blocking=True)
        for img, refs, i in zip(images, caps.tolist(), idx.tolist()):
            hyp = beam_search(encoder, decoder, img, word_map, beam_size)
            local.append((i, to_words(hyp, rev_map, word_map), [to_words(r, rev_map, word_map) for r in refs]))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    decoder.train()
    if dist.get_rank() != 0:
        return None
    res, gts = {}, {}
    for part in gathered:
        for i, hyp, refs in part:
            res[i], gts[i] = [hyp], refs
    bleu, _ = Bleu(4).compute_score(gts, res)
    cider, _ = Cider().compute_score(gts, res)
    return {"BLEU-4": bleu[3], "CIDEr": cider, "n_images": len(res)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data_folder", required=True)
    p.add_argument("--save_dir", default="checkpoints/sat")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--global_batch_size", type=int, default=128)
    p.add_argument("--decoder_lr", type=float, default=4e-4)
    p.add_argument("--alpha_c", type=float, default=1.0)
    p.add_argument("--grad_clip", type=float, default=5.0)
    p.add_argument("--beam_size", type=int, default=3)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", local_rank)

    with open(os.path.join(args.data_folder, f"WORDMAP_{DATA_NAME}.json")) as f:
        word_map = json.load(f)
    rev_map = {v: k for k, v in word_map.items()}

    encoder = Encoder().to(dev).eval()
    for prm in encoder.parameters():
        prm.requires_grad_(False)
    decoder = DecoderWithAttention(512, 512, 512, len(word_map)).to(dev)
    decoder = DDP(decoder, device_ids=[local_rank])
    optimizer = torch.optim.Adam(decoder.parameters(), lr=args.decoder_lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=8, gamma=0.8)

    train_set = CaptionDataset(args.data_folder, "TRAIN")
    val_set = CaptionDataset(args.data_folder, "VAL")
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.global_batch_size // dist.get_world_size(),
                              sampler=train_sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=16, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=4, pin_memory=True)

    os.makedirs(args.save_dir, exist_ok=True)
    best_cider = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (imgs, caps, caplens) in enumerate(train_loader):
            imgs, caps, caplens = imgs.to(dev), caps.to(dev), caplens.to(dev)
            with torch.no_grad():
                enc = encoder(imgs)
            scores, caps_sorted, dec_lens, alphas = decoder(enc, caps, caplens)
            targets = caps_sorted[:, 1:]
            scores = pack_padded_sequence(scores, dec_lens, batch_first=True).data
            targets = pack_padded_sequence(targets, dec_lens, batch_first=True).data
            loss = F.cross_entropy(scores, targets)
            loss = loss + args.alpha_c * ((1.0 - alphas.sum(dim=1)) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_value_(decoder.parameters(), args.grad_clip)
            optimizer.step()
            if i % 200 == 0:
                stat = loss.detach()
                dist.all_reduce(stat, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} [{i}/{len(train_loader)}] loss {stat.item():.4f} "
                          f"({time.time() - t0:.0f}s)", flush=True)
        scheduler.step()

        metrics = evaluate(encoder, decoder.module, val_loader, word_map, rev_map, args.beam_size, dev)
        if rank == 0:
            print(f"epoch {epoch} val {metrics}", flush=True)
            ckpt = {"epoch": epoch, "decoder": decoder.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "metrics": metrics}
            torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_last.pth.tar"))
            if metrics["CIDEr"] > best_cider:
                best_cider = metrics["CIDEr"]
                torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_best.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
