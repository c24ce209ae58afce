"""GIT-style captioner (image tokens prefixed to a causal text transformer) on COCO.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 03_git_caption_accelerate.py
"""
import argparse
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

import timm
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoTokenizer, get_linear_schedule_with_warmup
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ann_dir", default="data/coco/annotations")
    p.add_argument("--image_root", default="data/coco")
    p.add_argument("--output_dir", default="out/git_base")
    p.add_argument("--resume", default=None)
    p.add_argument("--encoder", default="vit_base_patch16_clip_224.openai")
    p.add_argument("--tokenizer", default="bert-base-uncased")
    p.add_argument("--dec_layers", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--enc_lr", type=float, default=1e-5)
    p.add_argument("--warmup_steps", type=int, default=1000)
    p.add_argument("--max_len", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class CocoCaptions(Dataset):
    """COCO 2014 caption annotations (captions_{train,val}2014.json)."""

    def __init__(self, ann_file, image_dir, transform, train):
        with open(ann_file) as f:
            data = json.load(f)
        self.files = {im["id"]: im["file_name"] for im in data["images"]}
        self.refs = {}
        for a in data["annotations"]:
            self.refs.setdefault(a["image_id"], []).append(a["caption"].strip())
        self.train = train
        self.items = ([(a["image_id"], a["caption"].strip()) for a in data["annotations"]]
                      if train else sorted(self.refs))
        self.image_dir = image_dir
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if self.train:
            image_id, caption = self.items[i]
        else:
            image_id, caption = self.items[i], ""
        img = Image.open(os.path.join(self.image_dir, self.files[image_id])).convert("RGB")
        return self.transform(img), caption, image_id


class GitCaptioner(nn.Module):
    def __init__(self, encoder_name, vocab_size, d_model=768, n_layers=6, n_heads=12, max_len=40):
        super().__init__()
        self.image_encoder = timm.create_model(encoder_name, pretrained=True, num_classes=0)
        self.visual_proj = nn.Sequential(nn.Linear(self.image_encoder.num_features, d_model), nn.LayerNorm(d_model))
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.1,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.decoder = nn.TransformerEncoder(layer, n_layers)
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight

    def _mask(self, n_img, n_txt, device):
        n = n_img + n_txt
        mask = torch.zeros(n, n, dtype=torch.bool, device=device)
        mask[:n_img, n_img:] = True  # image tokens do not see text
        mask[n_img:, n_img:] = torch.triu(torch.ones(n_txt, n_txt, dtype=torch.bool, device=device), 1)
        return mask

    def forward(self, pixel_values, input_ids, pad_mask=None):
        img = self.visual_proj(self.image_encoder.forward_features(pixel_values))
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        txt = self.tok_emb(input_ids) + self.pos_emb(pos)
        x = torch.cat([img, txt], dim=1)
        kpm = None
        if pad_mask is not None:
            kpm = torch.cat([torch.zeros(img.shape[:2], dtype=torch.bool, device=x.device), pad_mask], dim=1)
        x = self.decoder(x, mask=self._mask(img.size(1), txt.size(1), x.device), src_key_padding_mask=kpm)
        return self.lm_head(self.ln_f(x[:, img.size(1):]))

    @torch.no_grad()
    def generate(self, pixel_values, bos_id, eos_id, max_len):
        ids = torch.full((pixel_values.size(0), 1), bos_id, dtype=torch.long, device=pixel_values.device)
        for _ in range(max_len - 1):
            nxt = self.forward(pixel_values, ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            if (ids == eos_id).any(1).all():
                break
        return ids


def score(preds, refs):
    tok = PTBTokenizer()
    res = tok.tokenize({i: [{"caption": c}] for i, c in preds.items()})
    gts = tok.tokenize({i: [{"caption": c} for c in refs[i]] for i in preds})
    b, _ = Bleu(4).compute_score(gts, res, verbose=0)
    c, _ = Cider().compute_score(gts, res)
    return {"bleu4": b[3], "cider": c}


def main():
    args = parse_args()
    accelerator = Accelerator(log_with="tensorboard", project_dir=args.output_dir)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)

    cfg = timm.data.resolve_data_config({}, model=args.encoder)
    norm = transforms.Normalize(cfg["mean"], cfg["std"])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.6, 1.0)),
                                   transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(224), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    train_set = CocoCaptions(f"{args.ann_dir}/captions_train2014.json", f"{args.image_root}/train2014", train_tf, True)
    val_set = CocoCaptions(f"{args.ann_dir}/captions_val2014.json", f"{args.image_root}/val2014", val_tf, False)

    def collate(batch):
        images, captions, ids = zip(*batch)
        enc = tokenizer(list(captions), padding="longest", truncation=True,
                        max_length=args.max_len, return_tensors="pt")
        return torch.stack(images), enc.input_ids, enc.attention_mask, torch.tensor(ids)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8,
                              collate_fn=collate, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=64, shuffle=False, num_workers=8, collate_fn=collate)

    model = GitCaptioner(args.encoder, tokenizer.vocab_size, n_layers=args.dec_layers, max_len=args.max_len)
    enc_params = list(model.image_encoder.parameters())
    enc_ids = {id(p) for p in enc_params}
    optimizer = torch.optim.AdamW([
        {"params": enc_params, "lr": args.enc_lr},
        {"params": [p for p in model.parameters() if id(p) not in enc_ids], "lr": args.lr},
    ], weight_decay=0.01)
    # the prepared scheduler is stepped once per process, so count steps on the unsharded loader
    num_training_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps * accelerator.num_processes,
                                                num_training_steps)

    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler)
    accelerator.init_trackers("git_coco", config=vars(args))

    start_epoch = 0
    if args.resume:
        accelerator.load_state(args.resume)
        start_epoch = int(os.path.basename(args.resume.rstrip("/")).split("_")[-1]) + 1

    global_step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        model.train()
        for images, input_ids, attn, _ in train_loader:
            logits = model(images, input_ids[:, :-1], pad_mask=attn[:, :-1] == 0)
            labels = input_ids[:, 1:].masked_fill(attn[:, 1:] == 0, -100)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                   ignore_index=-100, label_smoothing=0.1)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            global_step += 1
            if global_step % 100 == 0:
                avg = accelerator.reduce(loss.detach(), reduction="mean")
                accelerator.log({"train/loss": avg.item(), "lr": scheduler.get_last_lr()[-1]}, step=global_step)

        # ---- evaluation on the full val2014 split ----
        model.eval()
        net = accelerator.unwrap_model(model)
        preds = {}
        for images, _, _, image_ids in val_loader:
            out = net.generate(images, tokenizer.cls_token_id, tokenizer.sep_token_id, args.max_len)
            out = accelerator.pad_across_processes(out, dim=1, pad_index=tokenizer.pad_token_id)
            out, image_ids = accelerator.gather_for_metrics((out, image_ids))
            if accelerator.is_main_process:
                for seq, iid in zip(out.tolist(), image_ids.tolist()):
                    preds[iid] = tokenizer.decode(seq, skip_special_tokens=True)
        if accelerator.is_main_process:
            metrics = score(preds, val_set.refs)
            accelerator.print(f"epoch {epoch}: {metrics} ({len(preds)} images)")
            accelerator.log({f"val/{k}": v for k, v in metrics.items()}, step=global_step)
            with open(os.path.join(args.output_dir, f"val_preds_{epoch}.json"), "w") as f:
                json.dump([{"image_id": k, "caption": v} for k, v in preds.items()], f)

        accelerator.wait_for_everyone()
        accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
        accelerator.save(accelerator.unwrap_model(model).state_dict(),
                         os.path.join(args.output_dir, "model_last.bin"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
