"""OCR-free receipt parsing: fine-tune Donut on CORD-v2 with DDP.

    torchrun --nproc_per_node=8 16_donut_cord_parsing.py --output_dir runs/donut_cord
"""
import argparse
import json
import os
import re

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import DonutProcessor, VisionEncoderDecoderConfig, VisionEncoderDecoderModel

TASK_START = "<s_cord-v2>"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", default="naver-clova-ix/donut-base")
    p.add_argument("--output_dir", default="runs/donut_cord")
    p.add_argument("--image_size", type=int, nargs=2, default=[1280, 960])
    p.add_argument("--max_length", type=int, default=768)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--val_every", type=int, default=3)
    return p.parse_args()


def json2token(obj, new_tokens, sort_keys=True):
    if isinstance(obj, dict):
        out = ""
        keys = sorted(obj.keys(), reverse=True) if sort_keys else obj.keys()
        for k in keys:
            new_tokens.update({f"<s_{k}>", f"</s_{k}>"})
            out += f"<s_{k}>" + json2token(obj[k], new_tokens, sort_keys) + f"</s_{k}>"
        return out
    if isinstance(obj, list):
        return "<sep/>".join(json2token(x, new_tokens, sort_keys) for x in obj)
    return str(obj)


def flatten(obj, prefix=""):
    """Flatten a parse tree into (path, value) pairs for field-level F1."""
    pairs = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            pairs += flatten(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(obj, list):
        for v in obj:
            pairs += flatten(v, prefix)
    else:
        pairs.append((prefix, str(obj).strip()))
    return pairs


class CordDonut(Dataset):
    def __init__(self, split_ds, processor, max_length, new_tokens, train):
        self.ds = split_ds
        self.processor = processor
        self.max_length = max_length
        self.train = train
        self.targets = []
        for gt in split_ds["ground_truth"]:
            parse = json.loads(gt)["gt_parse"]
            self.targets.append((json2token(parse, new_tokens) + processor.tokenizer.eos_token, parse))

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        pixel_values = self.processor(self.ds[i]["image"].convert("RGB"), random_padding=self.train,
                                      return_tensors="pt").pixel_values[0]
        seq, parse = self.targets[i]
        ids = self.processor.tokenizer(TASK_START + seq, add_special_tokens=False, max_length=self.max_length,
                                       padding="max_length", truncation=True, return_tensors="pt").input_ids[0]
        labels = ids.clone()
        labels[labels == self.processor.tokenizer.pad_token_id] = -100
        labels[0] = -100  # do not learn to predict the task prompt
        return {"pixel_values": pixel_values, "labels": labels, "idx": i}


@torch.no_grad()
def validate(model, loader, processor, dataset, device):
    model.eval()
    tok = processor.tokenizer
    counts = torch.zeros(3, device=device)  # matched, predicted, gold
    prompt_id = tok.convert_tokens_to_ids(TASK_START)
    for batch in loader:
        pix = batch["pixel_values"].to(device)
        prompt = torch.full((pix.size(0), 1), prompt_id, dtype=torch.long, device=device)
        outputs = model.generate(pix, decoder_input_ids=prompt, max_length=512, num_beams=1,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                 use_cache=True, bad_words_ids=[[tok.unk_token_id]])
        for seq, idx in zip(tok.batch_decode(outputs), batch["idx"].tolist()):
            seq = seq.replace(tok.eos_token, "").replace(tok.pad_token, "")
            seq = re.sub(r"<.*?>", "", seq, count=1).strip()
            pred = processor.token2json(seq)
            gold = dataset.targets[idx][1]
            p, g = flatten(pred), flatten(gold)
            remaining = list(g)
            hit = 0
            for pair in p:
                if pair in remaining:
                    remaining.remove(pair)
                    hit += 1
            counts += torch.tensor([hit, len(p), len(g)], device=device, dtype=torch.float)
    dist.all_reduce(counts)
    model.train()
    hit, n_pred, n_gold = counts.tolist()
    return 2 * hit / max(n_pred + n_gold, 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    config = VisionEncoderDecoderConfig.from_pretrained(args.pretrained)
    config.encoder.image_size = args.image_size
    config.decoder.max_length = args.max_length
    processor = DonutProcessor.from_pretrained(args.pretrained)
    processor.image_processor.size = {"height": args.image_size[0], "width": args.image_size[1]}
    processor.image_processor.do_align_long_axis = False

    raw = load_dataset("naver-clova-ix/cord-v2")
    new_tokens = set()
    train_set = CordDonut(raw["train"], processor, args.max_length, new_tokens, train=True)
    val_set = CordDonut(raw["validation"], processor, args.max_length, new_tokens, train=False)
    # same sorted list on every rank, so the resized embeddings line up
    processor.tokenizer.add_special_tokens({"additional_special_tokens": sorted(new_tokens) + [TASK_START]})

    model = VisionEncoderDecoderModel.from_pretrained(args.pretrained, config=config)
    model.decoder.resize_token_embeddings(len(processor.tokenizer))
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.decoder_start_token_id = processor.tokenizer.convert_tokens_to_ids(TASK_START)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    sampler = DistributedSampler(train_set, shuffle=True)
    train_dl = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)), batch_size=4,
                        num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.03)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pixel_values=batch["pixel_values"].to(device, non_blocking=True),
                             labels=batch["labels"].to(device, non_blocking=True)).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        if (epoch + 1) % args.val_every == 0 or epoch + 1 == args.epochs:
            f1 = validate(model, val_dl, processor, val_set, device)
            if rank == 0:
                print(f"epoch {epoch}: field F1 {f1:.4f}", flush=True)
                if f1 > best:
                    best = f1
                    model.module.save_pretrained(args.output_dir)
                    processor.save_pretrained(args.output_dir)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
