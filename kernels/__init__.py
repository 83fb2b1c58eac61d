"""Compute kernels. Each file holds one operation: the public function, and `*_ref`, its
plain-torch reference that the tests compare against."""
