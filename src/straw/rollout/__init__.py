"""straw.rollout: the RL rollout layer built on straw's public API (ROLLOUT.md).

Placeholder package marker on the ``engines`` branch; the rollout base defines the real
package contents and re-exports.
"""
