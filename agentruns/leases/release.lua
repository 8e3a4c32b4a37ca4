-- Delete the lease only while ARGV[1] still holds it.
-- KEYS[1]: lease key; ARGV[1]: owner.
-- Returns 1 if released, 0 if someone else (or nobody) holds it.
if redis.call("GET", KEYS[1]) == ARGV[1] then
  return redis.call("DEL", KEYS[1])
end
return 0
