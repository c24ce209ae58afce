"""
Phi-3-mini LoRA fine-tuning on customer-support dialogues, DDP over all local GPUs.

    torchrun --nproc_per_node 8 09_phi3_lora_ddp.py --train_jsonl data/support_train.jsonl \
        --eval_jsonl data/support_eval.jsonl --output_dir ckpt/phi3-support
"""
import argparse
import json
import logging
import math
import os
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, TaskType, get_peft_model
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

logger = logging.getLogger(__name__)


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", default="microsoft/Phi-3-mini-4k-instruct")
    parser.add_argument("--train_jsonl", required=True)
    parser.add_argument("--eval_jsonl", required=True)
    parser.add_argument("--output_dir", default="ckpt/phi3-support")
    parser.add_argument("--max_length", type=int, default=3072)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--num_warmup_steps", type=int, default=100)
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument("--checkpointing_steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


class DialogueDataset(Dataset):
    def __init__(self, path, tokenizer, max_length):
        self.features = []
        with open(path) as f:
            for line in f:
                conv = json.loads(line)["messages"]
                feat = self.build(conv, tokenizer, max_length)
                if feat is not None:
                    self.features.append(feat)

    @staticmethod
    def build(conv, tokenizer, max_length):
        ids = tokenizer.apply_chat_template(conv, tokenize=True)
        labels = [-100] * len(ids)
        # unmask each assistant reply (and its <|end|>) by rendering prefixes
        for i, m in enumerate(conv):
            if m["role"] != "assistant":
                continue
            start = len(tokenizer.apply_chat_template(conv[:i], tokenize=True, add_generation_prompt=True))
            end = len(tokenizer.apply_chat_template(conv[: i + 1], tokenize=True))
            labels[start:end] = ids[start:end]
        ids, labels = ids[:max_length], labels[:max_length]
        if all(l == -100 for l in labels):
            return None
        return {"input_ids": ids, "labels": labels}

    def __len__(self):
        return len(self.features)

    def __getitem__(self, idx):
        return self.features[idx]


def collate_fn(batch, pad_token_id):
    max_len = max(len(x["input_ids"]) for x in batch)
    input_ids = torch.full((len(batch), max_len), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), max_len), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for i, x in enumerate(batch):
        n = len(x["input_ids"])
        input_ids[i, :n] = torch.tensor(x["input_ids"])
        labels[i, :n] = torch.tensor(x["labels"])
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def run_eval(model, dataloader, device):
    model.eval()
    sums = torch.zeros(2, device=device)
    for batch in dataloader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        n_tok = (batch["labels"][:, 1:] != -100).sum()
        sums[0] += loss * n_tok
        sums[1] += n_tok
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[1]).item()


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    train_ds = DialogueDataset(args.train_jsonl, tokenizer, args.max_length)
    eval_ds = DialogueDataset(args.eval_jsonl, tokenizer, args.max_length)
    logger.info("train %d / eval %d conversations, world size %d", len(train_ds), len(eval_ds), world_size)

    collate = lambda b: collate_fn(b, tokenizer.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, sampler=train_sampler, batch_size=args.per_device_train_batch_size,
                          collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    eval_dl = DataLoader(eval_ds, sampler=DistributedSampler(eval_ds, shuffle=False),
                         batch_size=args.per_device_eval_batch_size, collate_fn=collate, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    peft_config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                             lora_dropout=0.05, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    model = get_peft_model(model, peft_config)
    if rank == 0:
        model.print_trainable_parameters()
    model.to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    num_update_steps_per_epoch = math.ceil(len(train_dl) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=max_train_steps)

    completed_steps = 0
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            outputs = model(**batch)
            loss = outputs.loss / args.gradient_accumulation_steps
            loss.backward()
            if (step + 1) % args.gradient_accumulation_steps == 0 or step == len(train_dl) - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1

                if completed_steps % 20 == 0:
                    reduced = loss.detach() * args.gradient_accumulation_steps
                    dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                    logger.info("epoch %d step %d loss %.4f lr %.3e", epoch, completed_steps,
                                reduced.item(), lr_scheduler.get_last_lr()[0])

                if completed_steps % args.checkpointing_steps == 0:
                    if rank == 0:
                        model.module.save_pretrained(os.path.join(args.output_dir, f"step_{completed_steps}"))
                    dist.barrier()

        eval_loss = run_eval(model, eval_dl, device)
        logger.info("epoch %d eval_loss %.4f perplexity %.2f", epoch, eval_loss, math.exp(eval_loss))

    if rank == 0:
        model.module.save_pretrained(args.output_dir)
        tokenizer.save_pretrained(args.output_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
