#!/usr/bin/env python
# BLIP-style generative VQA fine-tuning on VQAv2 (+VG), initialised from our
# image-text pre-training checkpoint.
import argparse
import json
import logging
import os
import random
from collections import Counter, defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

import timm
from transformers import BertConfig, BertLMHeadModel, BertModel, BertTokenizerFast

logger = logging.getLogger("blip_vqa")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_files", nargs="+", default=["data/vqa/vqa_train.json", "data/vqa/vg_qa.json"])
    ap.add_argument("--val_file", default="data/vqa/vqa_val.json")
    ap.add_argument("--image_root", default="data/images")
    ap.add_argument("--pretrained", default="checkpoints/pretrain_14m.pth")
    ap.add_argument("--output_dir", default="output/vqa")
    ap.add_argument("--vit", default="vit_base_patch16_384")
    ap.add_argument("--bert", default="bert-base-uncased")
    ap.add_argument("--image_size", type=int, default=480)
    ap.add_argument("--batch_size", type=int, default=16, help="per GPU")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--weight_decay", type=float, default=0.05)
    ap.add_argument("--max_q_len", type=int, default=35)
    ap.add_argument("--max_a_len", type=int, default=10)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


class VQADataset(Dataset):
    def __init__(self, files, image_root, transform, train=True):
        self.samples = []
        for f in files:
            with open(f) as fh:
                self.samples += json.load(fh)
        self.image_root = image_root
        self.transform = transform
        self.train = train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        s = self.samples[i]
        image = self.transform(Image.open(os.path.join(self.image_root, s["image"])).convert("RGB"))
        question = s["question"].lower().strip()
        if not self.train:
            return image, question, s["question_id"]
        counts = Counter(s["answer"])
        answers = list(counts.keys())
        weights = [c / len(s["answer"]) for c in counts.values()]
        return image, question, answers, weights


def train_collate(batch):
    images, questions, answers, weights, n = [], [], [], [], []
    for img, q, a, w in batch:
        images.append(img)
        questions.append(q)
        answers += a
        weights += w
        n.append(len(a))
    return torch.stack(images), questions, answers, torch.tensor(weights), torch.tensor(n)


def eval_collate(batch):
    images, questions, qids = zip(*batch)
    return torch.stack(images), list(questions), list(qids)


class BlipVQA(nn.Module):
    def __init__(self, vit_name, bert_name, image_size, embed_dim=256):
        super().__init__()
        self.visual_encoder = timm.create_model(vit_name, pretrained=False, num_classes=0,
                                                img_size=image_size, drop_path_rate=0.1)
        vision_width = self.visual_encoder.num_features
        enc_cfg = BertConfig.from_pretrained(bert_name, add_cross_attention=True)
        dec_cfg = BertConfig.from_pretrained(bert_name, add_cross_attention=True, is_decoder=True)
        self.text_encoder = BertModel(enc_cfg, add_pooling_layer=False)
        self.text_decoder = BertLMHeadModel(dec_cfg)
        text_width = enc_cfg.hidden_size
        # contrastive / matching heads of the pre-training model
        self.vision_proj = nn.Linear(vision_width, embed_dim)
        self.text_proj = nn.Linear(text_width, embed_dim)
        self.itm_head = nn.Linear(text_width, 2)

    def encode(self, image, q_ids, q_mask):
        image_embeds = self.visual_encoder.forward_features(image)
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image.device)
        q = self.text_encoder(input_ids=q_ids, attention_mask=q_mask,
                              encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts)
        return q.last_hidden_state

    def forward(self, image, q_ids, q_mask, a_ids, a_mask, weights, n_answers):
        q_states = self.encode(image, q_ids, q_mask)
        q_states = torch.repeat_interleave(q_states, n_answers, dim=0)
        q_atts = torch.repeat_interleave(q_mask, n_answers, dim=0)
        out = self.text_decoder(input_ids=a_ids, attention_mask=a_mask,
                                encoder_hidden_states=q_states, encoder_attention_mask=q_atts)
        targets = a_ids.masked_fill(a_mask == 0, -100)[:, 1:]
        tok_loss = F.cross_entropy(out.logits[:, :-1].transpose(1, 2), targets,
                                   ignore_index=-100, reduction="none")
        seq_loss = tok_loss.sum(dim=1)
        return (weights * seq_loss).sum() / image.size(0)

    @torch.no_grad()
    def answer(self, image, q_ids, q_mask, bos_id, eos_id, max_len):
        q_states = self.encode(image, q_ids, q_mask)
        ids = torch.full((image.size(0), 1), bos_id, dtype=torch.long, device=image.device)
        for _ in range(max_len):
            logits = self.text_decoder(input_ids=ids, encoder_hidden_states=q_states,
                                       encoder_attention_mask=q_mask).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
            if (ids == eos_id).any(dim=1).all():
                break
        return ids


def vqa_accuracy(pred, gt_answers):
    accs = []
    for i in range(len(gt_answers)):
        others = gt_answers[:i] + gt_answers[i + 1:]
        accs.append(min(1.0, sum(a == pred for a in others) / 3.0))
    return sum(accs) / len(accs)


@torch.no_grad()
def evaluate(model, loader, tok, val_anns, args, device):
    model.eval()
    local = []
    for images, questions, qids in loader:
        images = images.to(device, non_blocking=True)
        q = tok(questions, padding="longest", truncation=True, max_length=args.max_q_len,
                return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            ids = model.module.answer(images, q.input_ids, q.attention_mask,
                                      tok.cls_token_id, tok.sep_token_id, args.max_a_len)
        for qid, seq in zip(qids, ids.tolist()):
            local.append((qid, tok.decode(seq, skip_special_tokens=True).strip()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    model.train()
    if dist.get_rank() != 0:
        return None
    preds = dict(p for part in gathered for p in part)
    per_type = defaultdict(list)
    scores = []
    for qid, pred in preds.items():
        ann = val_anns[qid]
        s = vqa_accuracy(pred, ann["answer"])
        scores.append(s)
        per_type[ann.get("answer_type", "other")].append(s)
    result = {"overall": 100 * float(np.mean(scores))}
    result.update({k: 100 * float(np.mean(v)) for k, v in per_type.items()})
    return result


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    seed = args.seed + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    norm = transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.image_size, scale=(0.5, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([
        transforms.Resize((args.image_size, args.image_size), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor(), norm])

    train_set = VQADataset(args.train_files, args.image_root, train_tf, train=True)
    val_set = VQADataset([args.val_file], args.image_root, test_tf, train=False)
    val_anns = {s["question_id"]: s for s in val_set.samples}

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              collate_fn=train_collate)
    val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers, pin_memory=True, collate_fn=eval_collate)

    tok = BertTokenizerFast.from_pretrained(args.bert)
    model = BlipVQA(args.vit, args.bert, args.image_size)
    if args.pretrained:
        ckpt = torch.load(args.pretrained, map_location="cpu")
        msg = model.load_state_dict(ckpt["model"], strict=False)
        logger.info("loaded %s: missing=%d unexpected=%d", args.pretrained,
                    len(msg.missing_keys), len(msg.unexpected_keys))
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()
    os.makedirs(args.output_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        # cosine decay per epoch, as in the BLIP recipe
        lr = 0.5 * args.lr * (1 + np.cos(np.pi * epoch / args.epochs))
        for g in optimizer.param_groups:
            g["lr"] = lr
        model.train()
        running = torch.zeros(2, device=device)
        for it, (images, questions, answers, weights, n_ans) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            q = tok(questions, padding="longest", truncation=True, max_length=args.max_q_len,
                    return_tensors="pt").to(device)
            a = tok(answers, padding="longest", truncation=True, max_length=args.max_a_len,
                    return_tensors="pt").to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(images, q.input_ids, q.attention_mask, a.input_ids, a.attention_mask,
                             weights.to(device), n_ans.to(device))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if (it + 1) % 50 == 0:
                dist.all_reduce(running)
                logger.info("epoch %d it %d/%d loss %.4f lr %.2e", epoch, it + 1, len(train_loader),
                            (running[0] / running[1]).item(), lr)
                running.zero_()

        result = evaluate(model, val_loader, tok, val_anns, args, device)
        if rank == 0:
            logger.info("epoch %d VQA acc %s", epoch, json.dumps(result))
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, os.path.join(args.output_dir, "checkpoint_last.pth"))
            if result["overall"] > best:
                best = result["overall"]
                torch.save({"model": model.module.state_dict()}, os.path.join(args.output_dir, "checkpoint_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
