"""A custom reward function in verl's signature (loaded by path in the GRPO test): 1 for an
even number of characters, so random responses to one prompt get different scores."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2 == 0)
