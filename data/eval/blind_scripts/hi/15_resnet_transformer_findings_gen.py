"""
Findings generation for the in-house CXR archive: ResNet-50 grid features + Transformer decoder
(WordPiece vocab from CXR-BERT). Validation decodes greedily on every GPU and scores BLEU / METEOR
on rank 0.

    torchrun --nproc_per_node=4 15_resnet_transformer_findings_gen.py --ann /data/cxr_archive/ann.json \
        --img-dir /data/cxr_archive/png --work-dir work/r50_tf
"""
import argparse
import json
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from nltk.translate.bleu_score import corpus_bleu
from nltk.translate.meteor_score import meteor_score
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms
from transformers import AutoTokenizer

logger = logging.getLogger("findings")


class ArchiveDataset(Dataset):
    def __init__(self, records, img_dir, tokenizer, max_len, train):
        self.records = records
        self.img_dir = img_dir
        self.tokenizer = tokenizer
        self.max_len = max_len
        normalize = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        if train:
            self.transform = transforms.Compose([transforms.Resize(256), transforms.RandomCrop(224),
                                                 transforms.ToTensor(), normalize])
        else:
            self.transform = transforms.Compose([transforms.Resize((224, 224)), transforms.ToTensor(), normalize])

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        rec = self.records[idx]
        image = self.transform(Image.open(os.path.join(self.img_dir, rec["image"])).convert("RGB"))
        ids = self.tokenizer(rec["findings"], max_length=self.max_len, truncation=True, padding="max_length",
                             return_tensors="pt").input_ids[0]
        return image, ids, idx


class Captioner(nn.Module):
    def __init__(self, vocab_size, pad_id, bos_id, eos_id, d_model=512, n_layers=3, max_len=100):
        super().__init__()
        r50 = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
        self.cnn = nn.Sequential(*list(r50.children())[:-2])   # B x 2048 x 7 x 7
        self.feat_proj = nn.Conv2d(2048, d_model, 1)
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.pos = nn.Parameter(torch.randn(1, max_len, d_model) * 0.02)
        self.dec = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d_model, 8, 2048, 0.1, batch_first=True), n_layers)
        self.classifier = nn.Linear(d_model, vocab_size)
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id

    def memory(self, images):
        return self.feat_proj(self.cnn(images)).flatten(2).transpose(1, 2)

    def logits(self, mem, tokens):
        L = tokens.size(1)
        x = self.embed(tokens) + self.pos[:, :L]
        mask = nn.Transformer.generate_square_subsequent_mask(L, device=tokens.device)
        return self.classifier(self.dec(x, mem, tgt_mask=mask, tgt_key_padding_mask=tokens == self.pad_id))

    def forward(self, images, tokens):
        return self.logits(self.memory(images), tokens)

    @torch.no_grad()
    def greedy(self, images, max_len):
        mem = self.memory(images)
        out = torch.full((images.size(0), 1), self.bos_id, dtype=torch.long, device=images.device)
        finished = torch.zeros(images.size(0), dtype=torch.bool, device=images.device)
        for _ in range(max_len - 1):
            nxt = self.logits(mem, out)[:, -1].argmax(-1)
            nxt[finished] = self.pad_id
            out = torch.cat([out, nxt.unsqueeze(1)], dim=1)
            finished |= nxt == self.eos_id
            if finished.all():
                break
        return out


def validate(model, loader, tok, device, max_len):
    model.eval()
    world = dist.get_world_size()
    results = {}
    for images, ids, idx in loader:
        images, ids, idx = images.to(device), ids.to(device), idx.to(device)
        pred = model.module.greedy(images, max_len)
        all_pred = [torch.zeros_like(pred) for _ in range(world)]
        all_ref = [torch.zeros_like(ids) for _ in range(world)]
        all_idx = [torch.zeros_like(idx) for _ in range(world)]
        dist.all_gather(all_pred, pred)
        dist.all_gather(all_ref, ids)
        dist.all_gather(all_idx, idx)
        hyp_txt = tok.batch_decode(torch.cat(all_pred), skip_special_tokens=True)
        ref_txt = tok.batch_decode(torch.cat(all_ref), skip_special_tokens=True)
        # DistributedSampler repeats a few samples to even out the ranks; keep one copy of each
        for i, h, r in zip(torch.cat(all_idx).tolist(), hyp_txt, ref_txt):
            results[i] = (h, r)
    model.train()
    if dist.get_rank() != 0:
        return None
    hyps = [results[i][0] for i in sorted(results)]
    refs = [results[i][1] for i in sorted(results)]
    bleu4 = corpus_bleu([[r.split()] for r in refs], [h.split() for h in hyps])
    meteor = sum(meteor_score([r.split()], h.split()) for r, h in zip(refs, hyps)) / max(len(hyps), 1)
    return {"bleu4": bleu4, "meteor": meteor, "n": len(hyps)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ann", required=True)
    ap.add_argument("--img-dir", required=True)
    ap.add_argument("--work-dir", default="work/r50_tf")
    ap.add_argument("--tokenizer", default="microsoft/BiomedVLP-CXR-BERT-general")
    ap.add_argument("--max-len", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--val-every", type=int, default=2)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")

    tok = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=True)
    with open(args.ann) as f:
        ann = json.load(f)
    train_ds = ArchiveDataset(ann["train"], args.img_dir, tok, args.max_len, True)
    val_ds = ArchiveDataset(ann["val"], args.img_dir, tok, args.max_len, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=6, pin_memory=True,
                              drop_last=True)
    val_loader = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=6, pin_memory=True)

    model = Captioner(len(tok), tok.pad_token_id, tok.cls_token_id, tok.sep_token_id, max_len=args.max_len)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss(ignore_index=tok.pad_token_id)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)

    os.makedirs(args.work_dir, exist_ok=True)
    best_bleu = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (images, ids, _) in enumerate(train_loader):
            images, ids = images.to(device, non_blocking=True), ids.to(device, non_blocking=True)
            out = model(images, ids[:, :-1])
            loss = criterion(out.reshape(-1, out.size(-1)), ids[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            if it % 100 == 0:
                logger.info("epoch %d iter %d/%d loss %.4f", epoch, it, len(train_loader), loss.item())
        scheduler.step()

        if (epoch + 1) % args.val_every == 0:
            scores = validate(model, val_loader, tok, device, args.max_len)
            if rank == 0:
                logger.info("epoch %d val %s", epoch, json.dumps(scores))
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "scores": scores},
                           os.path.join(args.work_dir, "latest.pth"))
                if scores["bleu4"] > best_bleu:
                    best_bleu = scores["bleu4"]
                    torch.save(model.module.state_dict(), os.path.join(args.work_dir, "best_bleu4.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
