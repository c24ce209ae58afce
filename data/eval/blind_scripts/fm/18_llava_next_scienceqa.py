"""LLaVA-NeXT (Mistral-7B) on ScienceQA-IMG: multiple-choice SFT with FSDP.

Evaluation scores each option letter by its next-token logit after the prompt,
so no autoregressive decoding is needed.

    torchrun --nproc_per_node=8 18_llava_next_scienceqa.py --data-dir /data/scienceqa
"""
import argparse
import functools
import json
import logging
import os

import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import BackwardPrefetch, FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LlavaNextForConditionalGeneration, LlavaNextProcessor, get_cosine_schedule_with_warmup
from transformers.models.clip.modeling_clip import CLIPEncoderLayer
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

LETTERS = "ABCDE"
logger = logging.getLogger(__name__)


class ScienceQA(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, "problems.json")) as f:
            problems = json.load(f)
        with open(os.path.join(root, "pid_splits.json")) as f:
            pids = json.load(f)[split]
        self.items = [(pid, problems[pid]) for pid in pids if problems[pid].get("image")]
        self.img_root = os.path.join(root, split)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        pid, p = self.items[i]
        img = Image.open(os.path.join(self.img_root, pid, p["image"])).convert("RGB")
        opts = "\n".join(f"{LETTERS[k]}. {c}" for k, c in enumerate(p["choices"]))
        ctx = f"Context: {p['hint']}\n" if p.get("hint") else ""
        prompt = f"[INST] <image>\n{ctx}Question: {p['question']}\nOptions:\n{opts}\nAnswer with the option's letter. [/INST]"
        return img, prompt, LETTERS[p["answer"]], len(p["choices"])


class Collate:
    def __init__(self, processor, train):
        self.processor, self.train = processor, train

    def __call__(self, batch):
        imgs, prompts, answers, n_choices = zip(*batch)
        texts = [p + " " + a for p, a in zip(prompts, answers)] if self.train else list(prompts)
        enc = self.processor(images=list(imgs), text=texts, return_tensors="pt", padding=True)
        if self.train:
            labels = torch.full_like(enc["input_ids"], -100)
            last = enc["attention_mask"].sum(1) - 1  # right padding: answer letter is the last real token
            labels[torch.arange(len(batch)), last] = enc["input_ids"][torch.arange(len(batch)), last]
            enc["labels"] = labels
            return enc
        return enc, torch.tensor([LETTERS.index(a) for a in answers]), torch.tensor(n_choices)


@torch.no_grad()
def evaluate(model, loader, letter_ids, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for enc, gold, n_choices in loader:
        enc = enc.to(device)
        logits = model(**enc).logits
        last = enc["attention_mask"].sum(1) - 1
        scores = logits[torch.arange(len(last), device=device), last][:, letter_ids]
        mask = torch.arange(len(LETTERS), device=device)[None] >= n_choices.to(device)[:, None]
        pred = scores.masked_fill(mask, float("-inf")).argmax(-1)
        stats[0] += (pred == gold.to(device)).sum()
        stats[1] += len(gold)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llava-hf/llava-v1.6-mistral-7b-hf")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", default="ckpt/llava-next-sqa")
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup-ratio", type=float, default=0.03)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")

    # let one process per node populate the HF cache first
    if local_rank != 0:
        dist.barrier()
    processor = LlavaNextProcessor.from_pretrained(args.model)
    processor.tokenizer.padding_side = "right"
    model = LlavaNextForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float32)
    if local_rank == 0:
        dist.barrier()

    model.vision_tower.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    letter_ids = [processor.tokenizer.convert_tokens_to_ids(f"▁{c}") for c in LETTERS]

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={MistralDecoderLayer, CLIPEncoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, use_orig_params=True,
                 device_id=torch.cuda.current_device(),
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16))

    train_ds, val_ds = ScienceQA(args.data_dir, "train"), ScienceQA(args.data_dir, "val")
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=6,
                              collate_fn=Collate(processor, train=True), drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=Collate(processor, train=False))

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(train_loader)
    sched = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, enc in enumerate(train_loader):
            enc = enc.to(device)
            loss = model(**enc).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            sched.step()
            optimizer.zero_grad(set_to_none=True)
            if it % 25 == 0:
                logger.info("epoch %d it %d/%d loss %.4f", epoch, it, len(train_loader), loss.item())

        acc = evaluate(model, val_loader, letter_ids, device)
        logger.info("epoch %d val acc %.4f", epoch, acc)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            sd = model.state_dict()
        if rank == 0 and acc > best:
            best = acc
            os.makedirs(args.out, exist_ok=True)
            torch.save(sd, os.path.join(args.out, "best.pt"))
            logger.info("new best %.4f saved", best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
